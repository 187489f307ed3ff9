"""How SGLang dies. A control handler that raises in the scheduler is never turned into an HTTP error:
the scheduler logs "Scheduler hit an exception", SIGQUITs its parent, and the parent kills the process
tree (contract §2.1). torch_memory_saver errors call exit(1). The client sees a dropped connection."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

log = logging.getLogger("sglang.emulator")


def scheduler_exception(exc_type: str, message: str) -> NoReturn:
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "sglang/srt/managers/scheduler.py", in run_scheduler_process\n%s: %s',
        exc_type,
        message,
    )
    log.error("Received sigquit from a child process. It usually means the child failed.")
    _flush()
    os.kill(os.getpid(), signal.SIGKILL)  # kill_process_tree: nothing gets to answer
    raise SystemExit(1)  # unreachable; keeps type checkers honest


def memory_saver_exit(message: str) -> NoReturn:
    print(f"[torch_memory_saver.cpp] {message}", file=sys.stderr)
    _flush()
    os._exit(1)


def _flush() -> None:
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()
    sys.stdout.flush()
