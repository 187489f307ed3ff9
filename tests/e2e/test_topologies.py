"""Real topologies on a real API server: 4 pods as 2 SGLang instances x 2 nodes, 2 emulated GPUs per pod.

Every pod runs from the pod spec the operator generated: one SGLang command line for every pod
(`--nnodes $(RLJOB_NODES_PER_INSTANCE) --node-rank $(RLJOB_NODE_RANK) --dist-init-addr
$(RLJOB_INSTANCE_LEADER):PORT`), the stable names resolved through the fake kubelet's per-pod hosts
file. Node 0 of each instance serves SGLang's API; its release and resume reach the follower's ranks,
which free and map their own emulated GPU memory; the follower's agent verifies its own GPUs. The four
trainer containers form one world from the injected MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK and run a
checked all_reduce each step (torch.distributed with gloo when torch is importable, else the same check
over plain TCP, which the test reports as a warning; RLJOB_REQUIRE_TORCH=1, set by .ci/run, makes torch
required). With spec.trainer.processesPerPod 2 the trainer container is `torchrun`, which starts the
world from the injected PET_* variables alone."""

from __future__ import annotations

import copy
import json
import os
import sys
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.testing.collective import torch_available
from rljob.testing.harness import ROOT, OperatorProcess, get_rljob, phase_is, wait_rljob
from rljob.testing.kubeaccess import KubeApi, Kubectl
from rljob.testing.kubelet import ContainerContext, Kubelet, Launch, Mapping
from rljob.testing.pods import SIM_ARGS_ENV, TRAINER_ENTRY, classify, pod_loopback, rljob_mapping

pytestmark = pytest.mark.e2e

EXAMPLE = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
GiB = 1 << 30
LIFECYCLE = ("/release_memory_occupation", "/resume_memory_occupation", "/pause_generation", "/flush_cache")


@dataclass
class Topo:
    api: KubeApi
    kubectl: Kubectl
    namespace: str
    operator: OperatorProcess
    kubelet: Kubelet

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl.apply(manifest, namespace=self.namespace)

    def wait(self, name: str, *phases: str, timeout: float = 180) -> dict[str, Any]:
        return wait_rljob(
            self.api,
            self.namespace,
            name,
            phase_is(*phases),
            timeout,
            f"in {phases}",
            on_timeout=self.operator.log_tail,
        )

    def pods(self, name: str) -> dict[str, dict[str, Any]]:
        got = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=f"rljob.io/job={name}")
        return {p["metadata"]["name"]: p for p in got["items"]}

    def emulator(self, pod: dict[str, Any], path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{pod['status']['podIP']}:30000{path}", data=data)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def log(self, pod: str, container: str) -> str:
        uid = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods/{pod}")["metadata"]["uid"]
        runner = self.kubelet.runner(self.namespace, pod, uid)
        assert runner is not None, f"no runner for {pod}"
        return runner.log_path(container).read_text(errors="replace")

    def events(self, pod: str, container: str, kind: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log(pod, container).splitlines():
            if line.startswith("{") and f'"event": "{kind}"' in line:
                out.append(json.loads(line))
        return out


def torchrun_mapping(base: Mapping) -> Mapping:
    """A trainer container whose command is `torchrun ... -m rljob.testing.trainer ARGS` runs this
    interpreter's torchrun (torch.distributed.run) with the same options; every other container as `base`."""

    def mapping(ctx: ContainerContext) -> Launch | Any:
        argv = ctx.argv()
        c = classify(ctx)
        if c.kind != "trainer" or not argv or argv[0] != "torchrun":
            return base(ctx)
        options = [pod_loopback(a, ctx.pod_ip) for a in argv[1 : argv.index(TRAINER_ENTRY) + 1]]
        return Launch([sys.executable, "-u", "-m", "torch.distributed.run", *options, *c.args], env=c.env)

    return mapping


@pytest.fixture
def topo(
    admin_kubeconfig: Path,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Any,
    rljob_crd: None,
    tmp_path: Path,
) -> Iterator[Topo]:
    kubelet = kubelet_factory(mapping=torchrun_mapping(rljob_mapping()))
    assert kubelet.pod_hosts, (
        "this tier resolves the gang's names through per-pod hosts files (root, unshare)"
    )
    operator = OperatorProcess(admin_kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield Topo(kube_api, kubectl, namespace, operator, kubelet)
    finally:
        operator.stop()


def two_node_job(
    name: str,
    *,
    replicas: int = 4,
    per: int = 2,
    iterations: int = 3,
    master_port: int,
    sglang_args: tuple[str, ...] = (),
    sim_args: str = "",
    pod_sim_args: dict[int, str] | None = None,
    world: str = "auto",
    processes_per_pod: int = 1,
    train_seconds: float = 0.3,
    backoff: int = 2,
    **spec: Any,
) -> dict[str, Any]:
    """examples/rljob.yaml as a multi-node job: each pod 2 GPUs; with `per` 2 nodes per instance, TP 4."""
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": name}
    body = manifest["spec"]
    body.update(replicas=replicas, iterations=iterations, backoffLimit=backoff, podsAfterFinished="Keep")
    body.update(spec)
    body["rollout"] = {"podsPerInstance": per}
    body["trainer"] = {"masterPort": master_port, "processesPerPod": processes_per_pod}
    body["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = body["template"]["spec"]["containers"]
    nodes: tuple[str, ...] = ()
    if per > 1:
        nodes = ("--nnodes", "$(RLJOB_NODES_PER_INSTANCE)", "--node-rank", "$(RLJOB_NODE_RANK)")
        nodes += ("--tp-size", "4", "--dist-init-addr", f"$(RLJOB_INSTANCE_LEADER):{master_port + 1}")
    sglang["args"] = [*sglang["args"], *nodes, *sglang_args]
    sglang["resources"] = {"limits": {"nvidia.com/gpu": "2"}}  # a multi-GPU pod
    sglang["env"] = [
        *sglang.get("env", []),
        {"name": SIM_ARGS_ENV, "value": f"--tokens-per-second 0 {sim_args}"},
        *[{"name": f"{SIM_ARGS_ENV}_POD_{i}", "value": v} for i, v in (pod_sim_args or {}).items()],
    ]
    trainer["args"] = ["--prompts", "2", "--samples-per-prompt", "2", "--train-seconds", str(train_seconds)]
    trainer["args"] += ["--world", world]
    if processes_per_pod > 1:  # torchrun reads --nnodes, --nproc-per-node, ... from the injected PET_*
        trainer["command"] = ["torchrun", "-m", "rljob.testing.trainer"]
    return manifest


def report_world_backend(backends: set[str]) -> None:
    """Not silent: say which collective ran when it was not torch's."""
    if backends != {"torch"}:
        warnings.warn(
            f"the trainer world ran the torch-free TCP all_reduce ({sorted(backends)}): torch is not "
            "importable here (set RLJOB_REQUIRE_TORCH=1 to make it required)",
            stacklevel=2,
        )


def check_world(topo: Topo, pods: list[str], steps: int, per_pod: int = 1) -> set[str]:
    """Every trainer process ran `steps` checked collectives in one world of len(pods) x per_pod, each with
    its own rank: the injected env formed it (a wrong rank or size fails the step, or the trainer exits 3).
    Pod i's processes are ranks i*per_pod .. i*per_pod+per_pod-1 (RANK is the pod index with one process;
    torchrun numbers node-major). Under torch, the group's backend is gloo."""
    size = len(pods) * per_pod
    ranks, backends, groups = [], set(), set()
    for name in pods:
        index = int(name.rsplit("-", 1)[1])
        worlds = topo.events(name, "trainer", "world")
        assert len(worlds) == per_pod, topo.log(name, "trainer")[-2000:]
        collectives = topo.events(name, "trainer", "collective")
        assert len(collectives) >= steps * per_pod, topo.log(name, "trainer")[-2000:]
        assert {c["world_size"] for c in collectives} == {size}
        own = sorted({c["rank"] for c in collectives})
        assert own == [index * per_pod + i for i in range(per_pod)], own
        ranks += own
        backends |= {c["backend"] for c in collectives}
        groups |= {c.get("group_backend") for c in collectives}
    assert sorted(ranks) == list(range(size))
    if os.environ.get("RLJOB_REQUIRE_TORCH") == "1":
        assert backends == {"torch"}
    assert backends == ({"torch"} if torch_available() else {"tcp"})
    assert groups == ({"gloo"} if backends == {"torch"} else {None})
    return backends


def test_two_instances_of_two_nodes_run_three_iterations_in_one_trainer_world(topo: Topo) -> None:
    topo.apply(two_node_job("nodes", master_port=29631))
    obj = topo.wait("nodes", "Succeeded", timeout=240)
    status = obj["status"]
    assert status["weightVersion"] == "3" and status["restarts"] == 0, status.get("message")
    assert [w["version"] for w in status["weightHistory"]] == ["0", "1", "2", "3"]
    pods = topo.pods("nodes")
    assert sorted(pods) == [f"nodes-{i}" for i in range(4)]
    for name, pod in pods.items():
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        index = int(name.rsplit("-", 1)[1])
        assert env["RLJOB_NODE_RANK"] == str(index % 2) and env["RLJOB_INSTANCE"] == str(index // 2)
        stats = topo.emulator(pod, "/_emulator/stats")
        assert len(stats["memory"]["gpus"]) == 2  # a multi-GPU pod
        if index % 2 == 0:  # node 0 of its instance: SGLang's API, and the instance's lifecycle calls
            assert topo.emulator(pod, "/model_info")["weight_version"] == "3"
            assert stats["calls"]["/release_memory_occupation"] == 3
        else:  # a follower: its ranks freed and mapped their memory through the leader's calls
            assert stats["node_rank"] == 1 and stats["received"]["release"] == 3
            assert not set(stats["calls"]) & set(LIFECYCLE), stats["calls"]  # no SGLang call from its agent
            assert stats["offload_tags"] == []
    entries = {p["name"]: p for p in status["pods"]}
    for name in ("nodes-1", "nodes-3"):  # the followers' own GPUs were verified: 2 x (kv + weights + graph)
        assert entries[name]["weightVersion"] == "3"
    assert {p["gpus"] for p in status["pods"]} == {"Probe: 2 GPU(s)"}  # each agent's own 2 GPUs
    releasing = [s for s in status["timeline"] if s["phase"] == "Releasing"]
    assert releasing and all(s["freedBytes"] >= 4 * 56 * GiB for s in releasing)  # min per GPU, 4 pods
    report_world_backend(check_world(topo, sorted(pods), steps=3))
    # The followers' trainers asked for the GPU, trained and published like the leaders'; no rollout.
    assert topo.events("nodes-1", "trainer", "rollout")[0]["responses"] == 0
    assert topo.events("nodes-0", "trainer", "rollout")[0]["responses"] > 0


def test_a_follower_that_keeps_its_memory_gets_no_lease_and_status_names_its_gpus(topo: Topo) -> None:
    topo.apply(
        two_node_job(
            "keeps",
            master_port=29641,
            pod_sim_args={3: "--fault-release-ignore"},  # node 1 of instance 1 only
            backoff=0,
            world="none",
            release={"verify": {"timeoutSeconds": 3}},
        )
    )
    obj = topo.wait("keeps", "Failed", timeout=180)
    status = obj["status"]
    assert status["reason"] == "BackoffLimitExceeded", status
    assert "release failed on keeps-3" in status["message"], status["message"]
    assert "GPU 0 freed 0 of" in status["message"] and "GPU 1 freed 0 of" in status["message"]
    assert not [s for s in status["timeline"] if s["phase"] == "Training"]  # no lease on any pod
    entries = {p["name"]: p for p in status["pods"]}
    assert "release not verified within 3s: GPU 0 freed 0 of" in entries["keeps-3"].get("lastError", "")
    assert entries["keeps-1"].get("lastError") is None  # the other follower freed and verified its GPUs


def test_a_follower_pod_deleted_mid_iteration_restarts_the_gang(topo: Topo) -> None:
    topo.apply(two_node_job("lose", master_port=29651, iterations=2, train_seconds=2.0))
    topo.wait("lose", "Training", timeout=180)
    topo.api.delete(f"/api/v1/namespaces/{topo.namespace}/pods/lose-3")
    obj = topo.wait("lose", "Succeeded", timeout=300)
    status = obj["status"]
    assert status["restarts"] == 1 and status["weightVersion"] == "2", status.get("message")
    versions = [int(w["version"]) for w in status["weightHistory"]]
    assert versions == sorted(set(versions)), versions
    pods = topo.pods("lose")
    assert {p["metadata"]["labels"]["rljob.io/gang"] for p in pods.values()} == {"1"}
    check_world(topo, sorted(pods), steps=1)  # the new gang's trainers formed a new world


def test_data_parallel_inside_a_multi_gpu_pod(topo: Topo) -> None:
    """One pod per instance, 2 GPUs, dp_size 2 (SGLang refuses DP replicas across nodes, C-NODE)."""
    topo.apply(
        two_node_job("dp", replicas=2, per=1, iterations=2, master_port=29661, sglang_args=("--dp-size", "2"))
    )
    obj = topo.wait("dp", "Succeeded", timeout=180)
    assert obj["status"]["weightVersion"] == "2"
    for pod in topo.pods("dp").values():
        stats = topo.emulator(pod, "/_emulator/stats")
        assert [r["dp_rank"] for r in stats["ranks"]] == [0, 1] and len(stats["memory"]["gpus"]) == 2
    check_world(topo, ["dp-0", "dp-1"], steps=2)


def test_two_trainer_processes_per_pod_form_one_torch_world_under_torchrun(topo: Topo) -> None:
    """processesPerPod 2: the operator injects no WORLD_SIZE/RANK, only PET_*; the trainer container runs
    `torchrun -m rljob.testing.trainer` with no rendezvous options, and its 2 x 2 processes form one world
    (torch.distributed, gloo) whose all_reduce runs in every step; LOCAL_RANK 0 asks for and publishes the
    pod's lease, LOCAL_RANK 1 waits for it (Handoff)."""
    if not torch_available():
        pytest.fail("processesPerPod > 1 runs torchrun: torch must be installed (make install)")
    topo.apply(two_node_job("procs", replicas=2, per=1, iterations=2, master_port=29681, processes_per_pod=2))
    obj = topo.wait("procs", "Succeeded", timeout=240)
    status = obj["status"]
    assert status["weightVersion"] == "2" and status["restarts"] == 0, status.get("message")
    pods = topo.pods("procs")
    assert sorted(pods) == ["procs-0", "procs-1"]
    for name, pod in pods.items():
        trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["PET_NPROC_PER_NODE"] == "2" and env["PET_NNODES"] == "2"
        assert env["PET_NODE_RANK"] == name.rsplit("-", 1)[1]
        assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK"} & set(env), env  # torchrun sets them
        published = topo.events(name, "trainer", "published")
        # both processes of the pod published each version (LOCAL_RANK 1's publish only records it)
        assert sorted(p["version"] for p in published) == ["1", "1", "2", "2"], published
    assert check_world(topo, ["procs-0", "procs-1"], steps=2, per_pod=2) == {"torch"}


def test_replicas_that_are_not_a_multiple_of_pods_per_instance_are_refused(topo: Topo) -> None:
    manifest = two_node_job("odd", replicas=3, master_port=29671)
    result = topo.kubectl(
        "apply", "-f", "-", namespace=topo.namespace, input=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0
    assert "spec.rollout.podsPerInstance" in result.stderr
    assert "replicas must be a multiple of rollout.podsPerInstance" in result.stderr
    assert get_rljob_or_none(topo, "odd") is None


def get_rljob_or_none(topo: Topo, name: str) -> dict[str, Any] | None:
    try:
        return get_rljob(topo.api, topo.namespace, name)
    except Exception:
        return None
