"""The operator end to end on a real kube-apiserver + etcd: real kubectl, the real operator process, and
for every pod the real agent (from the pod spec the operator generated), the SGLang emulator and the
simulated trainer, run by the fake kubelet."""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.emulator.call_log import CALL_LOG_ENV
from rljob.testing.harness import ROOT, OperatorProcess, get_rljob, phase_is, rljob_path, wait_rljob
from rljob.testing.kubeaccess import KubeApi, Kubectl
from rljob.testing.kubelet import Kubelet
from rljob.testing.pods import SIM_ARGS_ENV, rljob_mapping

pytestmark = pytest.mark.e2e

EXAMPLE = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
# Every lifecycle route takes a little time, so a test can catch (and kill the operator in) any phase.
SLOW = " ".join(
    f"--fault-slow {route}=0.6"
    for route in (
        "/pause_generation",
        "/release_memory_occupation",
        "/update_weights_from_disk",
        "/continue_generation",
    )
)


@pytest.fixture(scope="session")
def crd(kubectl: Kubectl, kube_api: KubeApi) -> None:
    kubectl("apply", "-f", str(ROOT / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=30s")


@dataclass
class RL:
    api: KubeApi
    kubectl: Kubectl
    namespace: str
    operator: OperatorProcess
    kubelet: Kubelet

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl.apply(manifest, namespace=self.namespace)

    def get(self, name: str) -> dict[str, Any]:
        return get_rljob(self.api, self.namespace, name)

    def wait(self, name: str, *phases: str, timeout: float = 120) -> dict[str, Any]:
        return wait_rljob(
            self.api,
            self.namespace,
            name,
            phase_is(*phases),
            timeout,
            f"in {phases}",
            on_timeout=self.operator.log_tail,
        )

    def pods(self, name: str) -> list[dict[str, Any]]:
        got = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=f"rljob.io/job={name}")
        return list(got["items"])

    def emulator(self, pod: dict[str, Any], path: str) -> Any:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:30000{path}", timeout=5) as resp:
            return json.loads(resp.read())

    def events(self, name: str) -> list[dict[str, Any]]:
        got = self.api.get(
            f"/api/v1/namespaces/{self.namespace}/events", fieldSelector=f"involvedObject.name={name}"
        )
        return list(got["items"])


@pytest.fixture
def rl(
    admin_kubeconfig: Path,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Any,
    crd: None,
    tmp_path: Path,
) -> Iterator[RL]:
    kubelet = kubelet_factory(mapping=rljob_mapping())
    operator = OperatorProcess(admin_kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield RL(kube_api, kubectl, namespace, operator, kubelet)
    finally:
        operator.stop()


def job(
    name: str,
    *,
    iterations: int = 3,
    replicas: int = 2,
    backoff: int = 3,
    sim_args: str = "",
    keep: bool = True,
    sglang_args: tuple[str, ...] = (),
    train_seconds: float = 0.5,
    prompts: int = 4,
) -> dict[str, Any]:
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec.update(replicas=replicas, iterations=iterations, backoffLimit=backoff)
    if keep:
        spec["podsAfterFinished"] = "Keep"
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = spec["template"]["spec"]["containers"]
    sglang["args"] = [*sglang["args"], *sglang_args]
    sglang["env"] = [
        *sglang.get("env", []),
        {"name": SIM_ARGS_ENV, "value": f"--tokens-per-second 0 {sim_args}"},
    ]
    trainer["args"] = [
        "--prompts",
        str(prompts),
        "--samples-per-prompt",
        "2",
        "--train-seconds",
        str(train_seconds),
    ]
    return manifest


def _instant(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def versions(obj: dict[str, Any]) -> list[str]:
    return [w["version"] for w in obj["status"].get("weightHistory", [])]


def assert_monotonic(history: list[str]) -> None:
    numbers = [int(v) for v in history]
    assert numbers == sorted(set(numbers)), history


def test_three_iterations_succeed_and_every_pod_serves_the_third_version(rl: RL) -> None:
    rl.apply(job("three"))
    obj = rl.wait("three", "Succeeded", timeout=150)
    status = obj["status"]
    assert status["weightVersion"] == "3"
    assert versions(obj) == ["0", "1", "2", "3"]
    assert status["iteration"] == 3 and status["restarts"] == 0
    assert status["lastIteration"]["seconds"]["training"] > 0
    assert status["profile"]["verdict"] in ("RolloutBound", "TrainBound", "Balanced")
    pods = rl.pods("three")
    assert len(pods) == 2
    for pod in pods:
        assert rl.emulator(pod, "/model_info")["weight_version"] == "3"
        assert all(c["state"].get("running") for c in pod["status"]["containerStatuses"]), pod["status"]
    table = rl.kubectl("get", "rljob", "three", namespace=rl.namespace).stdout
    assert table.split()[:5] == ["NAME", "PHASE", "ITERATION", "WEIGHTS", "READY"]
    assert "Succeeded" in table and " 3 " in table
    wide = rl.kubectl("get", "rljob", "three", "-o", "wide", namespace=rl.namespace).stdout
    assert "ROLLOUT%" in wide and "RESTARTS" in wide
    described = rl.kubectl("describe", "rljob", "three", namespace=rl.namespace).stdout
    assert "WeightsCommitted" in described and "PhaseChanged" in described and "Completed" in described


VLLM_EXAMPLE = yaml.safe_load((ROOT / "examples/rljob-vllm.yaml").read_text())
VLLM_PORT = 8000  # engine: vllm's default rollout.port
REFITS = {"disk": ("/collective_rpc",), "tensor": ("/start_weight_update", "/finish_weight_update")}


def vllm_job(name: str, source: str, version: str, calls: Path, iterations: int = 3) -> dict[str, Any]:
    """examples/rljob-vllm.yaml, 2 pods, refitted from `source`, as vLLM `version` (its image tag), each
    emulator appending its lifecycle calls to `calls`."""
    manifest = copy.deepcopy(VLLM_EXAMPLE)
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec.update(replicas=2, iterations=iterations, podsAfterFinished="Keep", refit={"source": source})
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    vllm, trainer = spec["template"]["spec"]["containers"]
    vllm["image"] = f"vllm/vllm-openai:v{version}"
    vllm["env"] = [
        *vllm["env"],
        {"name": SIM_ARGS_ENV, "value": "--tokens-per-second 0"},
        {"name": CALL_LOG_ENV, "value": str(calls)},
    ]
    trainer["args"] = ["--prompts", "4", "--samples-per-prompt", "2", "--train-seconds", "0.5"]
    return manifest


def vllm_emulator(pod: dict[str, Any], path: str) -> Any:
    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{VLLM_PORT}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def handoffs(calls: Path) -> dict[str, list[tuple[str, str]]]:
    """Each vLLM server's lifecycle calls, (route, args) in the order they arrived, by its boot."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in calls.read_text().splitlines():
        entry = json.loads(line)
        if "route" in entry:
            out.setdefault(entry["boot"], []).append((entry["route"], entry["args"]))
    return out


@pytest.mark.parametrize(
    ("source", "version"),
    [("disk", "0.26.0"), ("tensor", "0.26.0"), ("disk", "0.34.0"), ("tensor", "0.34.0")],
    ids=["disk-0.26.0", "tensor-0.26.0", "disk-0.34.0", "tensor-0.34.0"],
)
def test_three_iterations_on_vllm_succeed_and_every_pod_serves_the_third_version(
    rl: RL, tmp_path: Path, source: str, version: str
) -> None:
    """engine: vllm, the whole loop: each release a sleep, each resume the weights woken, refitted (a
    disk reload or an IPC weight transfer), then the KV cache woken, which resumes vLLM; no call repeated,
    no gang restart, every pod serving the trainers' last weights."""
    name = f"vllm-{source}-{version.replace('.', '-')}"
    calls = tmp_path / "vllm-calls.jsonl"
    rl.apply(vllm_job(name, source, version, calls))
    obj = rl.wait(name, "Succeeded", timeout=150)
    status = obj["status"]
    # The launch weights are vLLM's "default" (the engine's initialVersion), then the trainers' 1, 2, 3.
    assert versions(obj) == ["default", "1", "2", "3"], status.get("message")
    assert status["weightVersion"] == "3"
    assert status["iteration"] == 3 and status["restarts"] == 0
    assert {p["engine"] for p in status["pods"]} == {f"vLLM {version}"}
    assert status["lastIteration"]["generationTokens"] > 0  # vLLM's counters, as its agents read them
    for pod in rl.pods(name):
        served = vllm_emulator(pod, "/_emulator/weights")
        assert served["source"] == source and not served["serves_garbage"], served
        if source == "disk":
            assert "weights-v3" in served["path"], served
        if version == "0.34.0":  # vLLM carries the label from 0.27 on: the agent set it
            assert vllm_emulator(pod, "/weight_info") == {"weight_version": "3"}
    table = rl.kubectl("get", "rljob", name, namespace=rl.namespace).stdout
    assert table.split()[5] == "ENGINE" and table.splitlines()[1].split()[5] == "vllm", table
    repeats = [json.loads(line) for line in calls.read_text().splitlines() if '"repeat": "' in line]
    assert repeats == [], repeats
    servers = handoffs(calls)
    assert len(servers) == 2, servers  # one server per pod, never restarted
    for sequence in servers.values():
        routes = [route for route, _ in sequence]
        assert routes.count("/sleep") == 3 and routes.count("/wake_up") == 6, sequence
        for i, (route, args) in enumerate(sequence):
            if (route, args) == ("/wake_up", "kv_cache"):  # nothing forwarded between the two wakes
                since = sequence[:i][::-1]
                woke = since.index(("/wake_up", "weights"))
                refit = [r for r, _ in since[:woke]]
                assert any(r in REFITS[source] for r in refit), sequence


@pytest.mark.parametrize(
    "phase", ["Initializing", "Rollout", "Draining", "Releasing", "Training", "Refitting", "Resuming"]
)
def test_operator_killed_in_each_phase_converges(rl: RL, phase: str) -> None:
    name = f"kill-{phase.lower()}"
    # Every phase lasts long enough to be seen: slow lifecycle routes, 1 s startup, 1 s training, and
    # generation at 100 tokens/s for the rollout.
    sim_args = f"--startup-seconds 1 --tokens-per-second 100 {SLOW}"
    rl.apply(job(name, iterations=2, sim_args=sim_args, train_seconds=1.0))
    seen = rl.wait(name, phase, timeout=90)
    rl.operator.kill()
    epoch_at_kill = seen["status"].get("epoch", 0)
    time.sleep(1.0)  # the world moves on without an operator
    rl.operator.start()
    obj = rl.wait(name, "Succeeded", timeout=150)
    status = obj["status"]
    assert status["restarts"] == 0, status.get("message")  # no emulator died, no gang restart
    assert status["weightVersion"] == "2"
    assert_monotonic(versions(obj))
    assert status["epoch"] >= epoch_at_kill
    for pod in rl.pods(name):
        assert rl.emulator(pod, "/model_info")["weight_version"] == "2"
        statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
        assert statuses["sglang"]["restartCount"] == 0 and "running" in statuses["sglang"]["state"]


@pytest.mark.parametrize("phase", ["Training", "Refitting"])
def test_pod_deleted_mid_iteration_recovers_at_committed_weights(rl: RL, phase: str) -> None:
    name = f"lose-{phase.lower()}"
    rl.apply(job(name, iterations=3, backoff=2, sim_args=SLOW, train_seconds=1.0))
    # In iteration 2, so the new gang must load committed weights "1", not the initial "0".
    wait_rljob(
        rl.api,
        rl.namespace,
        name,
        lambda o: o.get("status", {}).get("iteration", 0) == 2 and o.get("status", {}).get("phase") == phase,
        120,
        f"in {phase} of iteration 2",
    )
    victim = rl.pods(name)[1]["metadata"]["name"]
    rl.kubectl("delete", "pod", victim, "--grace-period=0", "--force", namespace=rl.namespace)
    # Recovering lasts one round (delete the gang, recreate it): too short to poll; restarts proves it.
    obj = rl.wait(name, "Succeeded", timeout=150)
    assert obj["status"]["restarts"] == 1
    assert obj["status"]["weightVersion"] == "3"
    assert_monotonic(versions(obj))
    events = rl.events(name)
    assert "GangMemberLost" in {e["reason"] for e in events}
    assert any("loading committed weights 1" in e["message"] for e in events)  # the rejoin refit
    for pod in rl.pods(name):
        assert rl.emulator(pod, "/model_info")["weight_version"] == "3"


def test_pod_lost_with_backoff_limit_zero_fails_and_stays_failed(rl: RL) -> None:
    name = "no-backoff"
    rl.apply(job(name, backoff=0, sim_args=SLOW, train_seconds=1.0))
    rl.wait(name, "Training", timeout=90)
    rl.kubectl("delete", "pod", f"{name}-0", "--grace-period=0", "--force", namespace=rl.namespace)
    obj = rl.wait(name, "Failed", timeout=30)
    assert obj["status"]["reason"] == "BackoffLimitExceeded"
    assert "backoffLimit 0" in obj["status"]["message"]
    conditions = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conditions["Failed"] == "True" and conditions["Ready"] == "False"
    time.sleep(4)  # several operator rounds later it is still Failed, and its pods are gone
    assert rl.get(name)["status"]["phase"] == "Failed"
    deadline = time.monotonic() + 20
    while rl.pods(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rl.pods(name) == []


def test_suspend_mid_rollout_and_resume_completes_at_the_committed_version(rl: RL) -> None:
    name = "suspend"
    rl.apply(job(name, iterations=3, prompts=20, sim_args="--tokens-per-second 100"))
    rl.wait(name, "Rollout", timeout=90)
    wait_rljob(
        rl.api,
        rl.namespace,
        name,
        lambda o: (
            o.get("status", {}).get("iteration", 0) >= 2 and o.get("status", {}).get("phase") == "Rollout"
        ),
        90,
        "in rollout of iteration 2",
    )
    rl.kubectl(
        "patch", "rljob", name, "--type=merge", "-p", '{"spec":{"suspend":true}}', namespace=rl.namespace
    )
    obj = rl.wait(name, "Suspended", timeout=60)
    committed = obj["status"]["weightVersion"]
    assert committed in ("1", "2")  # the iteration in flight when suspend landed committed first
    deadline = time.monotonic() + 20
    while rl.pods(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rl.pods(name) == []
    rl.kubectl(
        "patch", "rljob", name, "--type=merge", "-p", '{"spec":{"suspend":false}}', namespace=rl.namespace
    )
    obj = rl.wait(name, "Succeeded", timeout=150)
    assert obj["status"]["weightVersion"] == "3"
    assert versions(obj) == ["0", "1", "2", "3"]
    assert obj["status"]["restarts"] == 0
    reasons = {e["reason"] for e in rl.events(name)}
    assert {"Suspended", "Resumed"} <= reasons


def test_weight_cache_is_refused_before_memory_is_touched(rl: RL) -> None:
    name = "weight-cache"
    rl.apply(job(name, sglang_args=("--weight-cache-mode", "daemon")))
    obj = rl.wait(name, "Failed", timeout=60)
    status = obj["status"]
    assert status["reason"] == "WeightCacheActive"
    assert "--weight-cache-mode daemon" in status["message"]
    assert status["restarts"] == 0  # no emulator died: nothing was released or refitted
    assert "GangMemberLost" not in {e["reason"] for e in rl.events(name)}


def test_retract_that_the_version_cannot_do_fails_at_the_first_drain(rl: RL, tmp_path: Path) -> None:
    """docs/lifecycle.md, "Permanent refusals": SGLang 0.5.15.post1 counts retracted requests as work, so
    every agent refuses a retract drain for good. The job fails at the first drain, naming retract and what
    to change: no restart, one Warning, and no SGLang received a release."""
    name = "retract-old"
    manifest = job(name, sim_args="--sglang-version 0.5.15.post1")
    manifest["spec"]["rollout"] = {**manifest["spec"].get("rollout", {}), "drain": {"mode": "retract"}}
    calls_file = tmp_path / "sglang-calls.jsonl"  # outlives the pods, which a Failed job deletes
    sglang = manifest["spec"]["template"]["spec"]["containers"][0]
    sglang["env"] = [*sglang["env"], {"name": CALL_LOG_ENV, "value": str(calls_file)}]
    rl.apply(manifest)
    obj = rl.wait(name, "Failed", timeout=120)
    status = obj["status"]
    drains = [s["startTime"] for s in status["timeline"] if s["phase"] == "Draining"]
    assert len(drains) == 1, status["timeline"]
    took = (_instant(status["completionTime"]) - _instant(drains[0])).total_seconds()
    assert 0 <= took < 30, took
    assert status["reason"] == "RetractUnsupported", status
    assert "retract" in status["message"] and "spec.rollout.drain.mode: abort" in status["message"], status
    assert status["restarts"] == 0 and status["iteration"] == 1, status

    def warnings() -> list[str]:
        events = rl.events(name)
        return [
            e["reason"] for e in events if e["type"] == "Warning" and e["involvedObject"]["kind"] == "RLJob"
        ]

    deadline = time.monotonic() + 10  # events are posted after the status write
    while not warnings() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # and no second one follows
    assert warnings() == ["RetractUnsupported"]
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    assert len({c["boot"] for c in calls}) == 2, calls  # both pods' servers, once each: no restart
    routes = [c["route"] for c in calls if "route" in c]
    assert "/release_memory_occupation" not in routes and "/pause_generation" not in routes, routes
    print(f"the first drain -> Failed in {took:.2f} s (operator clock)")


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"release": {"tags": ["kv_cache", "in_place"]}}, "spec.release.tags[1]"),
        ({"rollout": {"drain": {"mode": "in_place"}}}, "spec.rollout.drain.mode"),
        ({"trainer": {"container": "sglang"}}, "spec.trainer.container"),
        ({"trainer": {"container": "nope"}}, "spec.trainer.container"),
        ({"replicas": 0}, "spec.replicas"),
    ],
)
def test_api_server_refuses_invalid_specs_with_the_field_path(
    rl: RL, patch: dict[str, Any], field: str
) -> None:
    manifest = job("invalid")
    manifest["spec"].update(patch)
    result = rl.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump(manifest), namespace=rl.namespace, check=False
    )
    assert result.returncode != 0
    assert field in result.stderr, result.stderr
    assert rl.api.get(rljob_path(rl.namespace))["items"] == []  # nothing was stored


def test_immutable_fields_are_refused_on_update(rl: RL) -> None:
    rl.apply(job("immutable", iterations=1))
    result = rl.kubectl(
        "patch",
        "rljob",
        "immutable",
        "--type=merge",
        "-p",
        '{"spec":{"replicas":3}}',
        namespace=rl.namespace,
        check=False,
    )
    assert result.returncode != 0 and "replicas is immutable" in result.stderr
    result = rl.kubectl(
        "patch",
        "rljob",
        "immutable",
        "--type=merge",
        "-p",
        '{"spec":{"release":{"tags":["kv_cache"]}}}',
        namespace=rl.namespace,
        check=False,
    )
    assert result.returncode != 0 and "release is immutable" in result.stderr


def test_deleting_the_job_cleans_up_its_children(rl: RL) -> None:
    name = "delete-me"
    rl.apply(job(name, iterations=1000))
    rl.wait(name, "Rollout", "Draining", "Releasing", "Training", "Refitting", "Resuming", timeout=90)
    rl.kubectl("delete", "rljob", name, "--wait=true", "--timeout=60s", namespace=rl.namespace)
    deadline = time.monotonic() + 30
    while rl.pods(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rl.pods(name) == []
    secrets = rl.api.get(f"/api/v1/namespaces/{rl.namespace}/secrets")["items"]
    assert not [s for s in secrets if s["metadata"]["name"] == f"{name}-agent-token"]


def test_gpu_example_is_accepted_by_the_api_server(rl: RL) -> None:
    """The realistic example (DRA ResourceClaimTemplate + RLJob) passes server-side validation."""
    result = rl.kubectl(
        "apply", "--dry-run=server", "-f", str(ROOT / "examples/rljob-gpu.yaml"), namespace=rl.namespace
    )
    assert "qwen3-8b-grpo created (server dry run)" in result.stdout
    assert "one-gpu created (server dry run)" in result.stdout
