"""Real processes for the agent tier: the SGLang emulator, the agent, the simulated trainer, each on free
loopback ports, plus a small stand-in for the operator's conductor. No mocks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PY = sys.executable
VERSIONS = ("0.5.6", "0.5.15.post1", "0.5.21", "0.5.23")
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
# C-DRAIN-RETRACT: waiting requests always count there, so a retract drain never becomes idle
RETRACT_REFUSED = ("0.5.15.post1", "0.5.20")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Reply:
    status: int
    body: Any
    text: str


def http(
    method: str,
    url: str,
    body: Any = None,
    *,
    token: str | None = None,
    raw: bytes | None = None,
    timeout: float = 15.0,
) -> Reply:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    text = payload.decode(errors="replace")
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = None
    return Reply(status, parsed, text)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = predicate()
        except (OSError, urllib.error.URLError):
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self._logf = log.open("wb")
        self.popen = subprocess.Popen(
            argv, stdout=self._logf, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait_exit(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def log_text(self) -> str:
        if not self._logf.closed:
            self._logf.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._logf.close()


class EmulatorProc(Proc):
    """An engine's emulator. It starts listening in the background (an agent can start meanwhile); the
    first direct call waits until it does."""

    url: str
    what = "emulator"  # in the message of a start that times out
    _ready = False

    def wait_ready(self, timeout: float = 15) -> None:
        if self._ready:
            return
        wait_until(
            lambda: not self.alive() or http("GET", self.url + "/_emulator/stats", timeout=2).status == 200,
            timeout,
            f"{self.what} to listen",
        )
        assert self.alive(), self.log_text()
        self._ready = True

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = 15, **kw: Any) -> Reply:
        self.wait_ready()
        return http(method, self.url + path, body, timeout=timeout, **kw)

    def stats(self) -> dict[str, Any]:
        return dict(self.call("GET", "/_emulator/stats").body)

    def weights(self) -> dict[str, Any]:
        return dict(self.call("GET", "/_emulator/weights").body)


class Emulator(EmulatorProc):
    """The SGLang emulator."""

    def __init__(
        self,
        tmp: Path,
        version: str = "0.5.23",
        *flags: str,
        env: dict[str, str] | None = None,
        memory_saver: bool = True,
        tps: float = 0,
        wait_ready: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = version
        argv = [
            PY,
            "-m",
            "rljob.emulator",
            "--port",
            str(self.port),
            "--sglang-version",
            version,
            "--tokens-per-second",
            str(tps),
            "--model-path",
            str(tmp / "launch-model"),
        ]
        if memory_saver:
            argv.append("--enable-memory-saver")
        super().__init__(f"emulator-{version}", [*argv, *flags], tmp / f"emulator-{self.port}.log", env)
        if wait_ready:
            self.wait_ready()

    def lifecycle_calls(self) -> int:
        return int(self.stats()["lifecycle_calls"])

    def memory(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/_emulator/memory").body["gpus"])

    def set_faults(self, **faults: Any) -> None:
        r = self.call("POST", "/_emulator/faults", faults)
        assert r.status == 200, r.text


class Agent(Proc):
    def __init__(
        self,
        tmp: Path,
        sglang_url: str,
        *extra: str,
        probe: str = "rljob.emulator.probe:EmulatorProbe",
        env: dict[str, str] | None = None,
    ) -> None:
        self.port, self.trainer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.trainer_url = f"http://127.0.0.1:{self.trainer_port}"
        self.token = f"token-{self.port}"
        token_file = tmp / f"agent-{self.port}.token"
        token_file.write_text(self.token + "\n")
        argv = [
            PY,
            "-m",
            "rljob.agent",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--trainer-listen",
            f"127.0.0.1:{self.trainer_port}",
            "--engine-server-url",
            sglang_url,
            "--token-file",
            str(token_file),
            "--gpu-probe",
            probe,
            "--rollout-report-seconds",
            "0.5",
            *extra,
        ]
        super().__init__("agent", argv, tmp / f"agent-{self.port}.log", env)
        wait_until(
            lambda: not self.alive() or http("GET", self.url + "/healthz", timeout=2).status == 200,
            15,
            "agent to listen",
        )
        assert self.alive(), self.log_text()

    # operator side
    def get(self, path: str, *, token: str | None = "default", timeout: float = 40) -> Reply:
        return http(
            "GET", self.url + path, token=self.token if token == "default" else token, timeout=timeout
        )

    def state(self, since: int | None = None, wait: float | None = None) -> dict[str, Any]:
        """The agent's state; with `since` and `wait`, the first one past revision `since` read within
        `wait` seconds (GET /v1/state is a plain read: the operator's reports travel on the channel)."""
        deadline = time.monotonic() + (wait or 0)
        while True:
            r = self.get("/v1/state")
            assert r.status == 200, r.text
            st = dict(r.body)
            if since is None or st["revision"] > since or time.monotonic() >= deadline:
                return st
            time.sleep(0.01)

    def command(self, action: str, epoch: int, *, wait: float = 20, **fields: Any) -> Reply:
        body = {"action": action, "epoch": epoch, **fields}
        suffix = f"?wait={wait}" if wait else ""
        return http("POST", self.url + "/v1/commands" + suffix, body, token=self.token, timeout=wait + 20)

    def wait_state(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 15, what: str = "state"
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        st = self.state()
        while not predicate(st):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}; last state: {json.dumps(st)[:2000]}")
            st = self.state(since=st["revision"], wait=round(min(left, 5), 2))
        return st

    def wait_stage(self, stage: str, timeout: float = 15) -> dict[str, Any]:
        return self.wait_state(lambda s: s["stage"] == stage, timeout, f"stage {stage}")

    # trainer side
    def trainer(self, method: str, path: str, body: Any = None, timeout: float = 40) -> Reply:
        return http(method, self.trainer_url + path, body, timeout=timeout)


class AgentDriver:
    """Test stand-in for the operator's lifecycle machine on one pod: epochs, commands, assertions."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.epoch = agent.state()["epoch"]  # continue after whatever the agent already accepted

    def send(self, action: str, *, wait: float = 20, **fields: Any) -> Reply:
        self.epoch += 1
        return self.agent.command(action, self.epoch, wait=wait, **fields)

    def ok(self, action: str, **fields: Any) -> dict[str, Any]:
        r = self.send(action, **fields)
        assert r.status == 200, f"{action}: HTTP {r.status}: {r.text}"
        assert r.body["state"] == "Succeeded", f"{action} failed: {r.body}"
        return dict(r.body)

    def done(self, action: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """A command to its end, however long it runs (a command's HTTP wait caps at 30 s): its status,
        which must be Succeeded (else the assertion shows the end of the agent's log)."""
        self.epoch += 1
        epoch = self.epoch
        r = self.agent.command(action, epoch, wait=25, **fields)
        assert r.status in (200, 202), f"{action}: HTTP {r.status}: {r.text}"
        st = self.agent.wait_state(
            lambda s: s["lastCommand"]["epoch"] == epoch and s["lastCommand"]["state"] != "Running",
            timeout,
            f"{action} to finish",
        )
        cmd = dict(st["lastCommand"])
        assert cmd["state"] == "Succeeded", f"{action} failed: {cmd}\n{self.agent.log_text()[-3000:]}"
        return cmd

    def failed(self, action: str, **fields: Any) -> dict[str, Any]:
        r = self.send(action, **fields)
        assert r.status == 200, f"{action}: HTTP {r.status}: {r.text}"
        assert r.body["state"] == "Failed", f"{action} unexpectedly {r.body['state']}: {r.body}"
        return dict(r.body)

    def refused(self, action: str, error: str | None = None, **fields: Any) -> dict[str, Any]:
        """A 409 refusal, and the emulator received no lifecycle call for it."""
        emulator_url = fields.pop("_emulator_url", None)
        before = (
            http("GET", emulator_url + "/_emulator/stats").body["lifecycle_calls"] if emulator_url else None
        )
        r = self.send(action, **fields)
        self.epoch -= 1  # a refused command is not accepted: its epoch may be reused
        assert r.status == 409, f"{action}: expected 409, got {r.status}: {r.text}"
        if error is not None:
            assert r.body["error"] == error, r.body
        assert r.body["reason"], r.body
        if emulator_url:
            after = http("GET", emulator_url + "/_emulator/stats").body["lifecycle_calls"]
            assert after == before, f"a refused {action} reached SGLang ({before} -> {after} lifecycle calls)"
        return dict(r.body)

    def publish(self, version: str, path: str | None) -> None:
        body = {"version": version} | ({"path": path} if path else {})
        r = self.agent.trainer("POST", "/v1/trainer/publish", body)
        assert r.status == 200, r.text

    def iteration_to_trained(
        self, version: str, path: str | None, tags: list[str] | None = None, **verify: Any
    ) -> None:
        self.ok("drain")
        self.ok("release", tags=tags or ALL_TAGS, **({"verify": verify} if verify else {}))
        self.ok("grant")
        self.publish(version, path)

    def full_iteration(self, version: str, path: str, tags: list[str] | None = None) -> None:
        self.iteration_to_trained(version, path, tags)
        self.ok("refit", version=version, path=path)
        self.ok("resume")


class Pod:
    """An emulator, its agent (Serving) and a conductor: what the `pod` fixture gives a test."""

    def __init__(self, emulator: Emulator, agent: Agent) -> None:
        self.emu = emulator
        self.agent = agent
        self.conductor = AgentDriver(agent)


def write_weights(directory: Path, version: str, size: int = 16 << 10) -> Path:
    from rljob.testing.trainer import make_tensors, write_checkpoint

    return write_checkpoint(directory, version, make_tensors(version, size))


def sha256_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
