"""slime, verl and AReaL under an RLJob, unchanged: each framework's own call sequence (tests/replays/*.json,
replayed byte for byte by rljob.testing.framework_trainer) is the trainer of a 2-pod job, pointed at the
agent's SGLang-compatible endpoint ($RLJOB_ENGINE_URL) instead of SGLang. Real API server, real operator,
real agents, the SGLang emulator at the version each framework pins."""

from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_operator
from test_operator import EXAMPLE, RL, versions

from rljob.emulator.call_log import CALL_LOG_ENV
from rljob.testing.client_replay import checkpoint_dir
from rljob.testing.harness import ROOT, wait_rljob
from rljob.testing.pods import SIM_ARGS_ENV

pytestmark = pytest.mark.e2e
rl = test_operator.rl  # the operator tier's fixtures, under their names
crd = test_operator.crd

REPLAYS = ROOT / "tests" / "replays"
# The refit each framework's colocated mode uses (docs/frameworks.md).
SOURCE = {"slime": "tensor", "verl": "tensor", "areal": "disk"}
BASE_ARGS = [
    "--model-path",
    "/weights/base",
    "--host",
    "127.0.0.1",
    "--port",
    "30000",
    "--weight-version",
    "0",
]


def framework_job(
    name: str,
    framework: str,
    calls: Path,
    *,
    command: list[str] | None = None,
    iterations: int = 3,
    trainer_args: tuple[str, ...] = (),
    pod_sim_args: dict[int, str] | None = None,
    source: str | None = None,
    sglang_version: str | None = None,
) -> dict[str, Any]:
    replay = json.loads((REPLAYS / f"{framework}.json").read_text())
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec.update(replicas=2, iterations=iterations, backoffLimit=0, podsAfterFinished="Keep")
    spec["refit"] = {"source": source or SOURCE[framework]}
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = spec["template"]["spec"]["containers"]
    flags = [f for f in replay["emulator_args"]]
    if "--enable-memory-saver" not in flags:  # the release must free memory the agent can verify
        flags.append("--enable-memory-saver")
    sglang["args"] = [*BASE_ARGS, *flags]
    sglang["env"] = [
        {
            "name": SIM_ARGS_ENV,
            "value": f"--tokens-per-second 0 --sglang-version {sglang_version or replay['sglang_version']}",
        },
        {"name": CALL_LOG_ENV, "value": str(calls)},
        *({"name": f"{SIM_ARGS_ENV}_POD_{i}", "value": v} for i, v in (pod_sim_args or {}).items()),
    ]
    trainer["command"] = command or [
        sys.executable,
        "-u",
        "-m",
        "rljob.testing.framework_trainer",
        "--replay",
        str(REPLAYS / f"{framework}.json"),
        *trainer_args,
    ]
    trainer.pop("args", None)
    return manifest


def succeeded_at_3(rl: RL, name: str) -> dict[str, Any]:
    """The job ends Succeeded with history 0..3, no restart, every pod serving 3; its status."""
    obj = rl.wait(name, "Succeeded", "Failed", timeout=300)
    status: dict[str, Any] = obj["status"]
    assert status["phase"] == "Succeeded", (status.get("reason"), status.get("message"))
    assert versions(obj) == ["0", "1", "2", "3"], status.get("weightHistory")
    assert status["restarts"] == 0
    for pod in rl.pods(name):
        assert rl.emulator(pod, "/model_info")["weight_version"] == "3"
    return status


def _call_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("framework", ["slime", "verl", "areal"])
def test_framework_sequence_runs_three_iterations_in_lock_step_and_its_exit_ends_the_job(
    rl: RL, framework: str, tmp_path: Path
) -> None:
    """The framework's trainer exits 0 right after its last call of iteration 3 (slime, verl: their last
    resume; AReaL: its last refit) while pod 1's SGLang resumes 3 s slower than pod 0's: pod 0's trainer
    has ended while the iteration in flight still resumes on pod 1. The job commits it and ends Succeeded
    because every trainer finished, before spec.iterations (5)."""
    name = f"fw-{framework}"
    calls = tmp_path / "calls.jsonl"
    slow = {1: "--fault-slow /resume_memory_occupation=3"}
    job = framework_job(
        name, framework, calls, iterations=5, trainer_args=("--iterations", "3"), pod_sim_args=slow
    )
    rl.apply(job)
    obj = rl.wait(name, "Succeeded", "Failed", timeout=300)
    status = obj["status"]
    assert status["phase"] == "Succeeded", (status.get("reason"), status.get("message"))
    assert status["reason"] == "TrainersFinished", status
    assert status["message"] == "every trainer finished after 3 of 5 iterations, serving weights 3", status
    assert status["iteration"] == 3
    assert versions(obj) == ["0", "1", "2", "3"], status.get("weightHistory")
    assert status["restarts"] == 0
    pods = rl.pods(name)
    assert len(pods) == 2
    for pod in pods:
        assert rl.emulator(pod, "/model_info")["weight_version"] == "3"
    lines = _call_lines(calls)
    assert [c for c in lines if c.get("repeat")] == [], "a non-idempotent SGLang call was repeated"
    releases = sorted(c["at"] for c in lines if c.get("route") == "/release_memory_occupation")
    assert len(releases) == 2 * 3, releases  # one per pod and iteration: the agent's, never the framework's
    # Lock-step: in each iteration no pod's SGLang is released before every pod's framework asked.
    asked = _asked(tmp_path)
    assert sorted(asked) == [1, 2, 3] and all(len(t) == 2 for t in asked.values()), asked
    for i in (1, 2, 3):
        first_release = releases[2 * (i - 1)]
        assert first_release > max(asked[i]), (i, first_release, asked[i])


def _asked(tmp_path: Path) -> dict[int, list[float]]:
    """When each pod's framework sent its release, per iteration, from the trainers' step logs."""
    asked: dict[int, list[float]] = {}
    for log in tmp_path.glob("kubelet-*/*/*/logs/trainer.log"):
        for line in log.read_text().splitlines():
            if not line.startswith("{"):
                continue
            step = json.loads(line)
            if step.get("part") == "handoff" and step["name"].startswith("release_memory_occupation"):
                asked.setdefault(step["iteration"], []).append(step["ts"] - step["seconds"])
    return asked


def test_a_framework_that_releases_on_one_pod_only_waits_and_status_names_the_other(
    rl: RL, tmp_path: Path
) -> None:
    name = "fw-one-pod"
    calls = tmp_path / "calls.jsonl"
    replay = str(REPLAYS / "verl.json")
    run = f"{sys.executable} -u -m rljob.testing.framework_trainer --replay {replay}"
    # Pod 1's trainer never gets to its release (its framework is still rolling out, say).
    command = ["sh", "-c", f'if [ "$RLJOB_POD_INDEX" = 1 ]; then exec sleep 3600; else exec {run}; fi']
    rl.apply(framework_job(name, "verl", calls, command=command))
    obj = wait_rljob(
        rl.api,
        rl.namespace,
        name,
        lambda o: "waiting for the trainers of" in (o.get("status", {}).get("message") or ""),
        90,
        "status to name the pods it waits for",
        on_timeout=rl.operator.log_tail,
    )
    status = obj["status"]
    assert status["phase"] == "Rollout", status
    assert status["message"].startswith("1 of 2 trainers asked for the GPU"), status["message"]
    assert status["message"].endswith(f"{name}-1"), status["message"]
    time.sleep(2)
    releases = [c for c in _call_lines(calls) if c.get("route") == "/release_memory_occupation"]
    assert releases == [], "a pod released before every trainer asked"
    assert rl.get(name)["status"]["phase"] == "Rollout"


def test_areal_start_up_offload_and_onload_run_unchanged(rl: RL, tmp_path: Path) -> None:
    """AReaL offloads and onloads once before its first step: release, then resume with nothing pushed
    (areal/trainer/rl_trainer.py:502-504,560-561@4aef98d8d818). The lease ends without weights, the gang
    serves the committed version 0 again (reloaded from the checkpoint SGLang launched from: the release
    discarded its weights), no version is recorded, and the three steps after it commit 1, 2, 3."""
    name = "fw-areal-startup"
    calls = tmp_path / "calls.jsonl"
    claim = tmp_path / "kubelet-0" / rl.namespace / "claims" / f"{name}-weights"
    checkpoint_dir(claim / "base", "0")  # the base model on the volume: SGLang's --model-path /weights/base
    rl.apply(framework_job(name, "areal", calls, trainer_args=("--startup",)))
    succeeded_at_3(rl, name)
    reasons = [e["reason"] for e in rl.events(name)]
    assert reasons.count("NoNewWeights") == 1, reasons
    lines = _call_lines(calls)
    assert [c for c in lines if c.get("repeat")] == [], "a non-idempotent SGLang call was repeated"
    # Each pod's SGLang loaded from disk 4 times: the committed 0 once, then versions 1, 2 and 3.
    loads = [c for c in lines if c.get("route") == "/update_weights_from_disk"]
    assert len(loads) == 2 * 4, loads


def test_a_refused_push_is_in_the_rljob_after_the_framework_exits(rl: RL, tmp_path: Path) -> None:
    """AReaL's disk refit to a job that refits from tensors: the endpoint refuses it with a 400, AReaL
    exits on it (without logging the body), and the reason is in the RLJob for its user to read."""
    name = "fw-refused"
    calls = tmp_path / "calls.jsonl"
    rl.apply(framework_job(name, "areal", calls, source="tensor"))
    obj = rl.wait(name, "Succeeded", "Failed", timeout=240)
    status = obj["status"]
    refusal = (
        "POST /update_weights_from_disk: rljob: this RLJob refits from tensor (spec.refit.source), not disk"
    )
    assert status["phase"] == "Failed", status
    assert "container trainer terminated (exit 2, Error)" in status["message"], status["message"]
    assert f"the agent last refused its trainer: {refusal}" in status["message"], status["message"]
    described = rl.kubectl("describe", "rljob", name, namespace=rl.namespace).stdout
    assert refusal in " ".join(described.split()), described
    events = [e for e in rl.events(name) if refusal in e["message"]]
    assert events, [e["message"] for e in rl.events(name)]


# The SGLang each client runs against: AReaL 1.0.4's pin (its `sglang` extra), and for verl the version whose
# modules its adapter imports here (rljob.testing.framework_clients: 0.9.1's pin, 0.5.12, is not unpacked).
CLIENT_SGLANG = {"verl": "0.5.20", "areal": "0.5.10.post1"}


@pytest.mark.parametrize("framework", ["verl", "areal"])
def test_the_frameworks_own_client_classes_drive_a_job_to_succeeded(
    rl: RL, framework: str, tmp_path: Path
) -> None:
    """verl's AsyncHttpServerAdapter and AReaL's RemoteSGLangEngine, installed from the package index, drive
    a 2-pod RLJob for 3 iterations through their own methods (rljob.testing.framework_clients): AReaL's
    start-up offload included, each client's trainer ending after its last call."""
    name = f"fw-client-{framework}"
    calls = tmp_path / "calls.jsonl"
    claim = tmp_path / "kubelet-0" / rl.namespace / "claims" / f"{name}-weights"
    checkpoint_dir(claim / "base", "0")  # the checkpoint SGLang launches from (AReaL's start-up reloads it)
    module = "rljob.testing.framework_clients"
    command = [sys.executable, "-u", "-m", module, "--framework", framework, "--iterations", "3"]
    rl.apply(framework_job(name, framework, calls, command=command, sglang_version=CLIENT_SGLANG[framework]))
    succeeded_at_3(rl, name)
    lines = _call_lines(calls)
    assert [c for c in lines if c.get("repeat")] == [], "a non-idempotent SGLang call was repeated"
    done = [
        json.loads(line)
        for log in tmp_path.glob("kubelet-*/*/*/logs/trainer.log")
        for line in log.read_text().splitlines()
        if line.startswith('{"ts"') and '"event": "done"' in line
    ]
    assert len(done) == 2, "each pod's client ran its 3 iterations to the end"


def test_trainers_that_exit_0_before_any_iteration_fail_the_job_instead_of_completing(
    rl: RL, tmp_path: Path
) -> None:
    """A framework that ends at once (no data, 0 steps, a wrong URL) exits 0 on every pod before any
    iteration: nothing was trained, so the job fails with what to look at, and Complete stays False (a
    pipeline waiting for it must not ship the launch weights)."""
    name = "fw-no-iteration"
    rl.apply(framework_job(name, "verl", tmp_path / "calls.jsonl", command=[sys.executable, "-c", "pass"]))
    obj = rl.wait(name, "Succeeded", "Failed", timeout=240)
    status = obj["status"]
    assert status["phase"] == "Failed" and status["reason"] == "NoIterationCommitted", status
    assert status["message"].startswith(
        "every trainer exited 0 without publishing weights: 0 of 3 iterations committed, the pods serve the "
        "initial weights 0"
    ), status["message"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert (conditions["Complete"], conditions["Failed"]) == ("False", "True"), conditions
    assert versions(obj) == ["0"] and status["restarts"] == 0
    _event(rl, name, lambda e: e["reason"] == "NoIterationCommitted" and e["type"] == "Warning")


def test_a_framework_that_exits_0_with_its_refit_window_open_is_a_lost_member_at_once(
    rl: RL, tmp_path: Path
) -> None:
    """verl's trainer exits 0 right after its tensor push, before the resume that closes its refit window:
    nobody will close it. The pod is a lost member at once (backoffLimit 0: the job fails, saying so),
    not after spec.refit.timeoutSeconds (an hour here) with the gang's GPUs idle."""
    name = "fw-window-open"
    push = "update_weights_from_tensor (one bucket)"
    job = framework_job(
        name, "verl", tmp_path / "calls.jsonl", trainer_args=("--iterations", "1", "--last-call", push)
    )
    job["spec"]["refit"]["timeoutSeconds"] = 3600
    job["spec"]["phaseTimeoutSeconds"] = {"refitting": 3600}
    rl.apply(job)
    obj = rl.wait(name, "Succeeded", "Failed", timeout=240)
    status = obj["status"]
    assert status["phase"] == "Failed" and status["reason"] == "BackoffLimitExceeded", status
    assert "its trainer finished (exit 0) with its refit window of weights 1 open" in status["message"], (
        status
    )
    _event(rl, name, lambda e: e["reason"] == "GangMemberLost" and "window of weights 1 open" in e["message"])
    assert versions(obj) == ["0"]


def _event(rl: RL, name: str, wanted: Callable[[dict[str, Any]], bool], timeout: float = 30) -> None:
    """An event of the job `wanted` picks is posted (the operator posts them after its status write)."""
    deadline = time.monotonic() + timeout
    while not any(wanted(e) for e in rl.events(name)):
        assert time.monotonic() < deadline, [(e["reason"], e["message"]) for e in rl.events(name)]
        time.sleep(0.5)
