"""The gang's layout (controller/topology.py): instances, node ranks, leaders, and the env every
container is told."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api import parse_spec
from rljob.api.base import InvalidObject
from rljob.api.crd import build_crd
from rljob.controller.children import AGENT_CONTAINER, AgentOptions, gang_pod
from rljob.controller.topology import Topology
from rljob.testing.kubelet import expand_vars

ROOT = Path(__file__).resolve().parents[2]


def test_four_pods_as_two_instances_of_two_nodes() -> None:
    t = Topology("rl", "team", replicas=4, pods_per_instance=2)
    assert t.instances == 2
    assert [(p.instance, p.node_rank, p.leader_index) for p in map(t.place, range(4))] == [
        (0, 0, 0),
        (0, 1, 0),
        (1, 0, 2),
        (1, 1, 2),
    ]
    assert [t.place(i).leader for i in range(4)] == [True, False, True, False]
    assert t.members(1) == [2, 3]
    assert t.instance_env(3) == {
        "RLJOB_INSTANCE": "1",
        "RLJOB_INSTANCES": "2",
        "RLJOB_NODE_RANK": "1",
        "RLJOB_NODES_PER_INSTANCE": "2",
        "RLJOB_INSTANCE_LEADER": "rl-2.rl.team.svc",
    }


def test_one_pod_per_instance_is_every_pod_its_own_leader() -> None:
    t = Topology("rl", "team", replicas=3)
    assert [t.place(i).leader for i in range(3)] == [True, True, True]
    assert t.instances == 3


def test_trainer_world_one_process_per_pod() -> None:
    t = Topology("rl", "team", replicas=4, pods_per_instance=2, master_port=29511)
    env = t.trainer_env(2)
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "rl-0.rl.team.svc"
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == "29511"
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("4", "2", "0")
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("4", "2", "1")
    ranks = sorted(int(t.trainer_env(i)["RANK"]) for i in range(4))
    assert ranks == [0, 1, 2, 3]


def test_trainer_world_under_torchrun_leaves_ranks_to_torchrun() -> None:
    env = Topology("rl", "team", replicas=2, trainer_processes_per_pod=8).trainer_env(1)
    assert "RANK" not in env and "WORLD_SIZE" not in env and "LOCAL_RANK" not in env
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("2", "1", "8")


@pytest.mark.parametrize(("replicas", "per"), [(3, 2), (0, 1), (4, 0)])
def test_replicas_must_be_a_multiple_of_pods_per_instance(replicas: int, per: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        Topology("rl", "team", replicas=replicas, pods_per_instance=per)


# --- the spec fields and the pods the operator builds from them -------------------------------------

EXAMPLE = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())


def example_spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(EXAMPLE["spec"])
    for path, value in changes.items():
        node = spec
        *parents, leaf = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return spec


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"replicas": 3, "rollout__podsPerInstance": 2},
            "rollout.podsPerInstance: replicas must be a multiple of rollout.podsPerInstance",
        ),
        ({"rollout__podsPerInstance": 0}, "spec.rollout.podsPerInstance: Input should be greater than"),
        (
            {"replicas": 4, "rollout__podsPerInstance": 2, "refit__source": "tensor"},
            "refit.source: refit.source tensor needs rollout.podsPerInstance 1",
        ),
        ({"trainer__masterPort": 8471}, "trainer.masterPort: trainer.masterPort must differ"),
        ({"trainer__masterPort": 30000}, "trainer.masterPort must differ"),
        ({"trainer__processesPerPod": 0}, "spec.trainer.processesPerPod: Input should be greater than"),
    ],
)
def test_the_models_refuse_a_layout_that_cannot_run(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(InvalidObject) as err:
        parse_spec(example_spec(**changes))
    assert expected in str(err.value)


def test_the_crd_states_the_layout_rules_with_their_fields() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["rule"]: r.get("fieldPath") for r in schema["x-kubernetes-validations"]}
    assert rules["self.replicas % self.rollout.podsPerInstance == 0"] == ".rollout.podsPerInstance"
    assert rules["self.refit.source != 'tensor' || self.rollout.podsPerInstance == 1"] == ".refit.source"
    rollout = schema["properties"]["rollout"]
    assert rollout["properties"]["podsPerInstance"]["default"] == 1
    assert rollout["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"  # immutable with rollout
    trainer = schema["properties"]["trainer"]["properties"]
    assert (trainer["processesPerPod"]["default"], trainer["masterPort"]["default"]) == (1, 29500)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def two_node_pods(**changes: Any) -> list[dict[str, Any]]:
    spec = parse_spec(example_spec(replicas=4, rollout__podsPerInstance=2, **changes))
    return [gang_pod("rl", "u", spec, i, 0, AgentOptions(), None) for i in range(4)]


def test_every_container_is_told_its_instance_and_the_trainer_its_world() -> None:
    pod = two_node_pods(trainer__masterPort=29511)[3]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    leader = "rl-2.rl.$(RLJOB_NAMESPACE).svc"  # the kubelet expands the namespace (env listed before)
    for name in ("sglang", "trainer", AGENT_CONTAINER):
        env = env_of(containers[name])
        assert (env["RLJOB_INSTANCE"], env["RLJOB_NODE_RANK"], env["RLJOB_NODES_PER_INSTANCE"]) == (
            "1",
            "1",
            "2",
        ), name
        assert env["RLJOB_INSTANCE_LEADER"] == leader
        names = [e["name"] for e in containers[name]["env"]]
        assert names.index("RLJOB_NAMESPACE") < names.index("RLJOB_INSTANCE_LEADER")
    trainer = env_of(containers["trainer"])
    assert (trainer["WORLD_SIZE"], trainer["RANK"], trainer["LOCAL_RANK"]) == ("4", "3", "0")
    assert trainer["MASTER_ADDR"] == trainer["PET_MASTER_ADDR"] == "rl-0.rl.$(RLJOB_NAMESPACE).svc"
    assert trainer["MASTER_PORT"] == "29511"
    assert "MASTER_ADDR" not in env_of(containers["sglang"])  # the world is the trainer's only
    assert pod["spec"]["hostname"] == "rl-3" and pod["spec"]["subdomain"] == "rl"


def test_injected_env_expands_in_args_and_the_user_env_wins() -> None:
    spec = example_spec(replicas=4, rollout__podsPerInstance=2)
    sglang = spec["template"]["spec"]["containers"][0]
    sglang["args"] += ["--nnodes", "$(RLJOB_NODES_PER_INSTANCE)", "--node-rank", "$(RLJOB_NODE_RANK)"]
    spec["template"]["spec"]["containers"][1]["env"].append({"name": "MASTER_PORT", "value": "1234"})
    pod = gang_pod("rl", "u", parse_spec(spec), 1, 0, AgentOptions(), None)
    sglang_out, trainer_out = pod["spec"]["containers"][:2]
    env = {k: v.replace("$(RLJOB_NAMESPACE)", "team") for k, v in env_of(sglang_out).items()}
    argv = [expand_vars(a, env) for a in sglang_out["args"]]
    assert argv[-4:] == ["--nnodes", "2", "--node-rank", "1"]
    assert [e["value"] for e in trainer_out["env"] if e["name"] == "MASTER_PORT"] == ["1234"]


def gpu_claim_spec(**changes: Any) -> dict[str, Any]:
    spec = example_spec(**changes)
    spec["template"]["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one"}]
    spec["template"]["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return spec


def test_tensor_refit_shares_the_process_namespace_and_the_gpu_claim() -> None:
    pod = gang_pod("rl", "u", parse_spec(gpu_claim_spec(refit__source="tensor")), 0, 0, AgentOptions(), None)
    assert pod["spec"]["shareProcessNamespace"] is True
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert containers["trainer"]["resources"]["claims"] == [{"name": "gpu"}]
    assert containers[AGENT_CONTAINER]["resources"]["claims"] == [{"name": "gpu"}]
    disk = gang_pod("rl", "u", parse_spec(gpu_claim_spec()), 0, 0, AgentOptions(), None)
    assert "shareProcessNamespace" not in disk["spec"]
    assert "claims" not in (disk["spec"]["containers"][1].get("resources") or {})


def test_a_trainer_that_lists_its_own_claims_keeps_them() -> None:
    spec = gpu_claim_spec(refit__source="tensor")
    spec["template"]["spec"]["containers"][1]["resources"] = {"claims": [{"name": "other"}]}
    pod = gang_pod("rl", "u", parse_spec(spec), 0, 0, AgentOptions(), None)
    assert pod["spec"]["containers"][1]["resources"]["claims"] == [{"name": "other"}]


def test_tensor_refit_refuses_a_template_without_a_shared_process_namespace() -> None:
    spec = example_spec(refit__source="tensor")
    spec["template"]["spec"]["shareProcessNamespace"] = False
    with pytest.raises(InvalidObject, match=r"shareProcessNamespace: .* another PID namespace"):
        parse_spec(spec)
    spec["refit"]["source"] = "disk"
    parse_spec(spec)  # the user's choice where no CUDA IPC crosses containers


def test_the_multinode_example_is_one_command_line_for_every_pod() -> None:
    docs = yaml.safe_load_all((ROOT / "examples/rljob-multinode.yaml").read_text())
    job = next(d for d in docs if d["kind"] == "RLJob")
    spec = parse_spec(job["spec"])
    argv = []
    for i in range(spec.replicas):
        pod = gang_pod("qwen", "u", spec, i, 0, AgentOptions(), None)
        sglang = pod["spec"]["containers"][0]
        env = {k: v.replace("$(RLJOB_NAMESPACE)", "rl") for k, v in env_of(sglang).items()}
        argv.append([expand_vars(a, env) for a in sglang["args"]])
    flags = [dict(zip(a[::2], a[1::2], strict=False)) for a in argv]
    assert [(f["--node-rank"], f["--nnodes"]) for f in flags] == [
        ("0", "2"),
        ("1", "2"),
        ("0", "2"),
        ("1", "2"),
    ]
    assert [f["--dist-init-addr"] for f in flags] == ["qwen-0.qwen.rl.svc:5000"] * 2 + [
        "qwen-2.qwen.rl.svc:5000"
    ] * 2
    trainer = env_of(gang_pod("qwen", "u", spec, 3, 0, AgentOptions(), None)["spec"]["containers"][1])
    assert (trainer["PET_NNODES"], trainer["PET_NODE_RANK"], trainer["PET_NPROC_PER_NODE"]) == ("4", "3", "8")
    assert "RANK" not in trainer  # torchrun sets the ranks of its 8 processes
