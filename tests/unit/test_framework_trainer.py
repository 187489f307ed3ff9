"""rljob.testing.framework_trainer against a local stand-in that records every request: for slime, verl and
AReaL it sends the recorded sequence's bodies byte for byte (placeholders filled), in order, for 2
iterations, the version substituted only where the framework names one; a reply failing a step's `expect`
exits 2 naming the step and its citation. And the fake kubelet runs it as a pod's container."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest

from rljob.testing import client_replay
from rljob.testing.framework_trainer import main, select
from rljob.testing.kubeaccess import KubeApi
from rljob.testing.kubelet import ContainerContext, Launch
from rljob.testing.pods import FRAMEWORK_TRAINER_ENTRY, rljob_mapping

ROOT = Path(__file__).resolve().parents[2]
REPLAYS = ROOT / "tests" / "replays"

# The recorded steps of one iteration, by index (the trainer selects them by name): launch wait, iteration.
ITERATION_STEPS = {
    "slime": (0, range(9, 21)),
    "verl": (None, range(5, 12)),
    "areal": (0, range(5, 14)),
}
# The final iteration stops at the framework's last call: AReaL's last refit (its next onload never comes).
LAST_STEPS = {"slime": range(9, 21), "verl": range(5, 12), "areal": range(5, 12)}


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StandIn:
    """Answers every route as SGLang would for these clients; records what it was sent."""

    requests: list[Request] = field(default_factory=list)
    version: str = "default"  # SGLang's weight_version at launch
    pushes_applied: int = 1_000  # pushes after this many leave the served version as it was
    replies: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> (status, body) override

    def answer(self, req: Request) -> tuple[int, str]:
        if req.path in self.replies:
            return self.replies[req.path]
        if req.path == "/generate":
            return 200, json.dumps(self.generated())
        if req.path == "/update_weights_from_tensor":
            pushed = json.loads(req.body).get("weight_version")
            self.pushes_applied -= 1
            if pushed is not None and self.pushes_applied >= 0:
                self.version = pushed
            return 200, json.dumps({"success": True, "message": "Succeeded to update model weights."})
        if req.path.startswith("/v1/loads"):
            return 200, json.dumps({"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})
        return 200, "null"

    def generated(self) -> dict[str, Any]:
        ids = [2, 4, 6]
        return {
            "text": "two four six",
            "output_ids": ids,
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "length", "length": 3},
                "weight_version": self.version,
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
            },
        }


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    state = StandIn()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def handle_any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            req = Request(self.command, self.path, dict(self.headers.items()), self.rfile.read(n))
            with lock:
                state.requests.append(req)
                status, text = state.answer(req)
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = handle_any

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def expected_body(client: str, step: dict[str, Any], iteration: int, weights: Path) -> bytes | None:
    body = step["body"]
    if body is None:
        return None
    values = {
        "FLATTENED_BUCKET_B64": client_replay.flattened_bucket_b64(),
        "LOCAL_SERIALIZED_NAMED_TENSORS_B64": client_replay.local_serialized_named_tensors_b64(),
        "WEIGHTS_DIR": str(weights / f"v{iteration}"),
    }
    for name, value in values.items():
        body = body.replace("{{" + name + "}}", value)
    if client == "slime" and '"weight_version"' in body:
        recorded = '"weight_version": "2"'  # the recorded push of the sequence's second iteration
        assert body.count(recorded) == 1, body[-200:]
        body = body.replace(recorded, f'"weight_version": "{iteration}"')
    return str(body).encode()


def run_trainer(
    monkeypatch: pytest.MonkeyPatch, url: str, weights: Path, client: str, iterations: int
) -> int:
    monkeypatch.setenv("RLJOB_ENGINE_URL", url)
    monkeypatch.setenv("RLJOB_WEIGHTS_DIR", str(weights))
    monkeypatch.delenv("RLJOB_POD_INDEX", raising=False)
    return main(["--replay", str(REPLAYS / f"{client}.json"), "--iterations", str(iterations)])


def checkpoint_version(directory: Path) -> str:
    (file,) = directory.glob("*.safetensors")
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return str(json.loads(raw[8 : 8 + n])["__metadata__"]["weight_version"])


def assert_sent(
    requests: list[Request], planned: list[tuple[int, dict[str, Any]]], client: str, weights: Path
) -> None:
    """Each request is its planned step's: method, path, recorded headers, body byte for byte."""
    assert [(r.method, r.path) for r in requests] == [(s["method"], s["path"]) for _, s in planned]
    for n, ((i, step), req) in enumerate(zip(planned, requests, strict=True)):
        where = f"request {n} ({step['name']}, iteration {i})"
        assert (req.body or None) == expected_body(client, step, i, weights), where
        for name, value in step.get("headers", {}).items():
            assert req.headers.get(name) == value, f"{where}: header {name}"


@pytest.mark.parametrize("client", sorted(ITERATION_STEPS))
def test_sends_the_recorded_bodies_byte_for_byte(
    client: str,
    stand_in: tuple[StandIn, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state, url = stand_in
    steps = client_replay.load(REPLAYS / f"{client}.json")["steps"]
    launch, iteration = ITERATION_STEPS[client]
    planned = [(0, steps[launch])] if launch is not None else []
    planned += [(1, steps[s]) for s in iteration] + [(2, steps[s]) for s in LAST_STEPS[client]]

    assert run_trainer(monkeypatch, url, tmp_path, client, 2) == 0

    assert_sent(state.requests, planned, client, tmp_path)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["name"], x["status"]) for x in lines if x["event"] == "step"] == [
        (s["name"], 200) for _, s in planned
    ]
    assert lines[-1]["event"] == "done"
    if client == "areal":  # a real checkpoint per iteration, at the path the disk update names
        assert [checkpoint_version(tmp_path / f"v{i}") for i in (1, 2)] == ["1", "2"]


def test_last_call_ends_the_last_iteration_after_that_step(
    stand_in: tuple[StandIn, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--last-call: a framework that ends in the middle of its handoff (verl exiting after its push, its
    refit window left open): the last iteration stops after that step, and the trainer exits 0."""
    state, url = stand_in
    steps = client_replay.load(REPLAYS / "verl.json")["steps"]
    monkeypatch.setenv("RLJOB_ENGINE_URL", url)
    monkeypatch.setenv("RLJOB_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.delenv("RLJOB_POD_INDEX", raising=False)
    push = "update_weights_from_tensor (one bucket)"
    argv = ["--replay", str(REPLAYS / "verl.json"), "--iterations", "1", "--last-call", push]
    assert main(argv) == 0
    sent = [steps[s]["name"] for s in ITERATION_STEPS["verl"][1]]
    assert [r.path for r in state.requests] == [steps[s]["path"] for s in ITERATION_STEPS["verl"][1]][
        : sent.index(push) + 1
    ]
    with pytest.raises(ValueError, match="is not a handoff step of verl"):
        main(["--replay", str(REPLAYS / "verl.json"), "--last-call", "no such step"])


def test_areal_start_up_offload_and_onload_come_before_iteration_1(
    stand_in: tuple[StandIn, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--startup: AReaL's offload (pause, release) and its first step's onload (resume, continue), with no
    weights pushed between them (areal/trainer/rl_trainer.py:502-504,560-561@4aef98d8d818)."""
    state, url = stand_in
    steps = client_replay.load(REPLAYS / "areal.json")["steps"]
    planned = [(0, steps[i]) for i in range(0, 5)] + [(1, steps[s]) for s in range(5, 12)]
    monkeypatch.setenv("RLJOB_ENGINE_URL", url)
    monkeypatch.setenv("RLJOB_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.delenv("RLJOB_POD_INDEX", raising=False)
    assert main(["--replay", str(REPLAYS / "areal.json"), "--iterations", "1", "--startup"]) == 0
    assert_sent(state.requests, planned, "areal", tmp_path)


def test_a_reply_failing_expect_exits_2_naming_the_step(
    stand_in: tuple[StandIn, str], tmp_path: Path
) -> None:
    state, url = stand_in
    state.replies["/update_weights_from_tensor"] = (200, json.dumps({"success": False, "message": "no"}))
    done = subprocess.run(
        [sys.executable, "-m", "rljob.testing.framework_trainer", "--replay", str(REPLAYS / "slime.json")],
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("RLJOB_")},
            "RLJOB_ENGINE_URL": url,
            "RLJOB_WEIGHTS_DIR": str(tmp_path),
            "RLJOB_ITERATIONS": "2",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    push = client_replay.load(REPLAYS / "slime.json")["steps"][18]
    assert f"{push['name']} ({push['cite']})" in done.stderr
    assert '"success": false' in done.stderr  # the reply
    assert state.requests[-1].path == "/update_weights_from_tensor"  # nothing sent after it


def test_a_rollout_on_the_previous_version_exits_2(
    stand_in: tuple[StandIn, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slime's rollout of iteration 3 must read weight_version 2 (the recording says 1)."""
    state, url = stand_in
    state.pushes_applied = 1  # the push of iteration 2 is answered but not applied
    assert run_trainer(monkeypatch, url, tmp_path, "slime", 3) == 2
    generates = [r for r in state.requests if r.path == "/generate"]
    assert len(generates) == 5  # iteration 1 and 2's rollouts, then the first sample of iteration 3


def test_an_iteration_is_a_contiguous_run_of_the_recording() -> None:
    steps = client_replay.load(REPLAYS / "slime.json")["steps"]
    with pytest.raises(ValueError, match="contiguous"):
        select(steps, ("generate (sample 0)", "flush_cache (before release)"))


def test_the_fake_kubelet_runs_it_on_this_interpreter_at_the_pods_loopback(tmp_path: Path) -> None:
    replay = str(REPLAYS / "areal.json")
    container = {"name": "trainer", "command": ["python3", "-m", FRAMEWORK_TRAINER_ENTRY, "--replay", replay]}
    env = {"RLJOB_ENGINE_URL": "http://127.0.0.1:8473"}
    ctx = ContainerContext({}, container, "127.0.0.7", tmp_path, {}, env, cast(KubeApi, None))
    launch = rljob_mapping()(ctx)
    assert isinstance(launch, Launch)
    assert list(launch.argv) == [sys.executable, "-u", "-m", FRAMEWORK_TRAINER_ENTRY, "--replay", replay]
    assert launch.env["RLJOB_ENGINE_URL"] == "http://127.0.0.7:8473"
