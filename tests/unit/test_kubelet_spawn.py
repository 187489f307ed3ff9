"""The fake kubelet starts containers through `setpriv --pdeathsig KILL` (no preexec_fn: no Python in a
forked child of a big process) and the kernel still kills them when the thread that started them dies;
a command that does not resolve keeps the preexec_fn, so Popen refuses it as before (StartError)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from rljob.testing import kubelet
from rljob.testing.cluster import die_with_parent

pytestmark = pytest.mark.skipif(kubelet.SETPRIV is None, reason="setpriv (util-linux) is not installed")
ENV = {"PATH": os.environ.get("PATH", os.defpath)}


def test_a_resolvable_command_goes_through_setpriv(tmp_path: Path) -> None:
    argv, preexec = kubelet.killed_with_parent(["sleep", "5"], ENV, tmp_path)
    assert argv == [kubelet.SETPRIV, "--pdeathsig", "KILL", "--", "sleep", "5"] and preexec is None


def test_a_command_that_does_not_resolve_keeps_the_preexec_fn(tmp_path: Path) -> None:
    argv, preexec = kubelet.killed_with_parent(["no-such-command-here"], ENV, tmp_path)
    assert argv == ["no-such-command-here"] and preexec is die_with_parent
    with pytest.raises(FileNotFoundError):
        subprocess.Popen(argv, env=ENV, cwd=tmp_path, preexec_fn=preexec)
    argv, preexec = kubelet.killed_with_parent(["./missing.sh"], ENV, tmp_path)
    assert preexec is die_with_parent


def test_the_child_dies_with_the_thread_that_started_it(tmp_path: Path) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        argv, preexec = kubelet.killed_with_parent(["sleep", "30"], ENV, tmp_path)
        started.append(subprocess.Popen(argv, env=ENV, cwd=tmp_path, preexec_fn=preexec))
        # A runner thread lives on after it started a container; setpriv sets the signal once it runs,
        # after Popen returned (a thread that died before that would leave the child to another thread).
        time.sleep(0.5)

    t = threading.Thread(target=start)
    t.start()
    t.join()  # the thread is gone: its child gets SIGKILL
    proc = started[0]
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode == -9
