"""Run the operator against a (local) API server with simulated GPU pods: shared by the e2e tier, the
demo and the benchmarks. Nothing here fakes our own code: the operator, the agents, the emulator and
the trainer are the real programs, started as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rljob.api.crd import GROUP, PLURAL, VERSION
from rljob.testing.kubeaccess import KubeApi

ROOT = Path(__file__).resolve().parents[3]


class OperatorProcess:
    """`rljob-operator` as a child process: start, SIGKILL (to test restarts), stop."""

    def __init__(
        self,
        kubeconfig: Path | str,
        namespaces: Sequence[str],
        log_path: Path,
        extra_args: Sequence[str] = (),
        agent_gpu_probe: str = "rljob.emulator.probe:EmulatorProbe",
    ) -> None:
        """`agent_gpu_probe`: the agents' --gpu-probe (`nvml` for pods on a real GPU)."""
        self.kubeconfig = Path(kubeconfig)
        self.namespaces = list(namespaces)
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.agent_gpu_probe = agent_gpu_probe
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        argv = [
            sys.executable,
            "-u",
            "-m",
            "rljob.controller.main",
            "--agent-gpu-probe",
            self.agent_gpu_probe,
            "--metrics-port",
            "0",
            "--health-endpoint",
            "",
            "--tick-seconds",
            "1",
        ]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        return argv + self.extra_args

    def start(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n=== operator start #{self.starts + 1}\n".encode())
        self.proc = subprocess.Popen(
            self.argv(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.starts += 1
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, no last status write — the harshest restart."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rljob_path(namespace: str, name: str = "", sub: str = "") -> str:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def get_rljob(api: KubeApi, namespace: str, name: str) -> dict[str, Any]:
    return api.get(rljob_path(namespace, name))


def wait_rljob(
    api: KubeApi,
    namespace: str,
    name: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float,
    what: str,
    poll: float = 0.05,
    on_timeout: Callable[[], str] = lambda: "",
) -> dict[str, Any]:
    """Poll the RLJob until `predicate(obj)`; fail with the last status seen."""
    deadline = time.monotonic() + timeout
    obj: dict[str, Any] = {}
    while time.monotonic() < deadline:
        obj = get_rljob(api, namespace, name)
        if predicate(obj):
            return obj
        time.sleep(poll)
    status = obj.get("status", {})
    raise TimeoutError(
        f"{namespace}/{name}: not {what} after {timeout}s; phase={status.get('phase')} "
        f"reason={status.get('reason')} message={status.get('message')}\n{on_timeout()}"
    )


def phase_is(*phases: str) -> Callable[[dict[str, Any]], bool]:
    return lambda obj: obj.get("status", {}).get("phase") in phases
