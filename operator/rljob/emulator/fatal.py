"""How SGLang dies (C-DEATH-EXC, C-DEATH-HARD in docs/sglang-conformance.md).

- A Python exception in the scheduler (assert, KeyError, RuntimeError) is never turned into an HTTP error:
  the scheduler logs "Scheduler hit an exception", SIGQUITs its parent, and the parent kills the process
  tree (…/managers/scheduler.py:2695-2698@0.5.6, tokenizer_manager.py:2490-2495@0.5.6). Every version.
- A hard exit of the scheduler process (torch_memory_saver's exit(1), SIGKILL, OOM-kill) raises nothing.
  From 0.5.10 the SubprocessWatchdog sees the child gone with a non-zero code and SIGQUITs the server
  (…/utils/watchdog.py:166-223@0.5.15.post1). 0.5.6 has no watchdog: the HTTP server stays up, /ping
  answers 200, and every call that needs the scheduler waits forever (`SchedulerDied`).

The client of a dying server sees a dropped connection; the client of a 0.5.6 zombie sees no answer."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("sglang.emulator")


class SchedulerDied(Exception):
    """The scheduler process is gone and nothing noticed (0.5.6): the HTTP layer makes the call hang."""


class StartupError(Exception):
    """The scheduler raised while starting: launch fails and the port never opens."""


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


def memory_saver_message(message: str) -> None:
    print(f"[torch_memory_saver.cpp] {message}", file=sys.stderr)


def scheduler_process_exit(message: str, *, watchdog: bool, zombie: Callable[[], None]) -> None:
    """The scheduler process is gone (exit code 1 or a signal). With the watchdog the server exits; without
    it `zombie()` marks the scheduler dead and the caller returns (a route then raises SchedulerDied)."""
    if watchdog:
        log.error(
            "Subprocess scheduler_0 (pid=%d) crashed with exit code 1. Triggering SIGQUIT for cleanup (%s)",
            os.getpid(),
            message,
        )
        _flush()
        os._exit(1)
    log.error("scheduler process died (%s); no watchdog in this version: the HTTP server stays up", message)
    _flush()
    zombie()


def _flush() -> None:
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stderr.flush()
    sys.stdout.flush()
