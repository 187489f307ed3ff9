"""The gang's layout (controller/topology.py): instances, node ranks, leaders, and the env every
container is told."""

from __future__ import annotations

import pytest

from rljob.controller.topology import Topology


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
