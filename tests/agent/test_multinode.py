"""A multi-node SGLang instance (C-NODE): node 0's emulator serves SGLang's API and reaches the other node's
ranks over the --dist-init-addr channel; the follower's emulator serves only the dummy health routes. The
leader's agent makes the SGLang calls; the follower's agent (--node-rank 1, agent/follower.py) never does,
and verifies its own GPUs. Here the test stands in for the operator's order (the follower after its leader,
as LOCK_STEPS' after_leader rows do)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agent_procs import (
    ALL_TAGS,
    Agent,
    AgentDriver,
    Emulator,
    Proc,
    free_port,
    http,
    wait_until,
    write_weights,
)

from rljob.emulator.http_common import LIFECYCLE_ROUTES
from rljob.emulator.launch import GiB

KV, WEIGHTS, GRAPH = 40 * GiB, 16 * GiB, 2 * GiB


def instance(
    procs: list[Proc], tmp: Path, *follower_flags: str, tp: int = 4, gpus: int = 2
) -> tuple[Emulator, Emulator, Agent, Agent]:
    """Node 0 and node 1 of one instance (TP `tp`, `gpus` GPUs per node), each with its agent."""
    addr = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--dist-init-addr", addr, "--tp-size", str(tp), "--gpus", str(gpus))
    follower = Emulator(tmp, "0.5.23", *common, "--node-rank", "1", *follower_flags)
    leader = Emulator(tmp, "0.5.23", *common, "--node-rank", "0")
    procs += [follower, leader]
    leader_agent = Agent(tmp, leader.url)
    follower_agent = Agent(tmp, follower.url, "--node-rank", "1")
    procs += [leader_agent, follower_agent]
    for agent in (leader_agent, follower_agent):
        agent.wait_stage("Ready")
    return leader, follower, leader_agent, follower_agent


def both(a: AgentDriver, b: AgentDriver, action: str, **fields: Any) -> None:
    """The leader's command first; the follower's once the leader's finished (after_leader)."""
    a.ok(action, **fields)
    b.ok(action, **fields)


def test_the_follower_frees_and_maps_its_own_memory_through_the_leaders_calls(
    procs: list[Proc], tmp_path: Path
) -> None:
    _leader, follower, la, fa = instance(procs, tmp_path)
    assert fa.state()["nodeRank"] == 1 and la.state()["nodeRank"] == 0
    assert http("GET", follower.url + "/server_info").status == 404  # the dummy server has no API
    lc, fc = AgentDriver(la), AgentDriver(fa)
    both(lc, fc, "resume", version="0")  # open rollout at the launch version
    assert fa.state()["engine"]["servedVersion"] == "0"
    used = [g["used_bytes"] for g in follower.memory()]
    assert len(used) == 2 and all(u >= KV + WEIGHTS for u in used)  # real emulated memory on both GPUs

    lc.ok("drain")
    fc.ok("drain")  # the follower's before-sample
    assert fa.state()["memory"]["usedBeforeBytes"] == sum(used)
    lc.ok("release", tags=ALL_TAGS)
    freed = [g["regions"] for g in follower.memory()]
    assert all(r["kv_cache"] == 0 and r["weights"] == 0 for r in freed)  # the leader's call reached node 1
    fc.ok("release", tags=ALL_TAGS)
    st = fa.state()
    assert st["stage"] == "Released" and st["memory"]["verified"] is True
    assert st["memory"]["freedBytes"] >= KV + WEIGHTS and st["releasedTags"] == ALL_TAGS

    both(lc, fc, "grant")
    path = write_weights(tmp_path / "weights", "1")
    for c in (lc, fc):
        c.publish("1", str(path))
    both(lc, fc, "refit", version="1", path=str(path))
    assert all(g["regions"]["weights"] == WEIGHTS for g in follower.memory())  # mapped by the leader's resume
    lc.ok("resume")
    fc.ok("resume", version="1")  # the version its leader verified
    for agent in (la, fa):
        st = agent.state()
        assert st["stage"] == "Serving" and st["engine"]["servedVersion"] == "1", st
    assert [g["used_bytes"] for g in follower.memory()] == used
    stats = follower.stats()
    assert stats["received"] == {"release": 1, "resume": 2}  # weights at refit, kv_cache at resume
    assert not set(stats["calls"]) & LIFECYCLE_ROUTES  # the follower's agent never called SGLang's API
    assert "/ping" in stats["calls"]  # its liveness


@pytest.mark.emulator_may_die
def test_a_follower_that_keeps_its_memory_is_not_verified_and_gets_no_lease(
    procs: list[Proc], tmp_path: Path
) -> None:
    _leader, _follower, la, fa = instance(procs, tmp_path, "--fault-release-ignore")
    lc, fc = AgentDriver(la), AgentDriver(fa)
    both(lc, fc, "resume", version="0")
    both(lc, fc, "drain")
    lc.ok("release", tags=ALL_TAGS)  # node 0's own GPUs freed: the leader's agent cannot tell more
    failed = fc.failed("release", tags=ALL_TAGS, verify={"timeoutSeconds": 2})
    assert "release not verified within 2s: GPU 0 freed 0 of" in failed["error"], failed
    assert "GPU 1 freed 0 of" in failed["error"]
    assert fa.state()["memory"]["verified"] is False
    assert fa.state()["stage"] == "Drained"
    fc.refused("grant", "IllegalTransition")  # the trainer of this pod never gets the GPU


@pytest.mark.emulator_may_die
def test_the_follower_dies_with_its_instance_and_its_agent_says_so(procs: list[Proc], tmp_path: Path) -> None:
    leader, follower, _la, fa = instance(procs, tmp_path)
    leader.stop()  # node 0 is gone: the other nodes' ranks exit
    wait_until(lambda: not follower.alive(), 10, "the follower's ranks to exit")
    st = fa.wait_stage("Failed", timeout=10)
    assert "SGLang stopped answering" in st["fatal"]


@pytest.mark.emulator_may_die
def test_a_lost_follower_kills_node_0(procs: list[Proc], tmp_path: Path) -> None:
    leader, follower, la, _fa = instance(procs, tmp_path)
    follower.stop()
    wait_until(lambda: not leader.alive(), 10, "node 0 to die without the ranks of node 1")
    assert "the ranks on node 1 are gone" in leader.log_text()
    assert la.wait_stage("Failed", timeout=10)["fatal"]


@pytest.mark.emulator_may_die
@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--dp-size", "2", "--tp-size", "2"), "multi-node data-parallel replicas are not supported"),
        (("--tp-size", "3"), "tp_size must be divisible by number of nodes"),
        (("--node-rank", "2"), "node_rank 2 is not in [0, nnodes=2)"),
    ],
)
def test_launch_refuses_what_sglang_refuses_across_nodes(
    procs: list[Proc], tmp_path: Path, flags: tuple[str, ...], error: str
) -> None:
    emu = Emulator(tmp_path, "0.5.23", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1", *flags)
    procs.append(emu)
    assert emu.wait_exit(15) == 1
    assert error in emu.log_text()


def test_several_trainer_processes_of_a_pod_share_one_lease_request_and_one_publish(
    procs: list[Proc], tmp_path: Path
) -> None:
    """torchrun with nproc 2 in one pod: both ranks use Handoff().train(); only LOCAL_RANK 0 talks to the
    agent's lease routes, rank 1 waits for the pod's lease and its publish only records the version."""
    import threading

    from rljob.trainer import Handoff

    emu = Emulator(tmp_path, "0.5.23")
    procs.append(emu)
    agent = Agent(tmp_path, emu.url)
    procs.append(agent)
    agent.wait_stage("Ready")
    conductor = AgentDriver(agent)
    conductor.ok("resume")
    ranks = [Handoff(agent.trainer_url, local_rank=r) for r in (0, 1)]
    calls: dict[int, list[tuple[str, str]]] = {0: [], 1: []}
    for r, h in enumerate(ranks):
        real = h.client.call

        def counted(method: str, path: str, *a: Any, _r: int = r, _real: Any = real, **kw: Any) -> Any:
            calls[_r].append((method, path))
            return _real(method, path, *a, **kw)

        h.client.call = counted  # type: ignore[method-assign]
    epochs: dict[int, int | None] = {}

    def step(r: int) -> None:
        with ranks[r].train(timeout=30) as lease:
            epochs[r] = lease.epoch
            lease.publish("1", str(path))

    path = write_weights(tmp_path / "weights", "1")
    follower_rank = threading.Thread(target=step, args=(1,))
    follower_rank.start()  # waits for the pod's lease without asking for it
    wait_until(lambda: calls[1], 5, "rank 1 to wait for the lease")
    leader_rank = threading.Thread(target=step, args=(0,))
    leader_rank.start()
    agent.wait_state(lambda s: s["trainer"]["requested"], 10, "the pod's lease request")
    conductor.ok("drain")
    conductor.ok("release", tags=ALL_TAGS)
    conductor.ok("grant")
    for t in (leader_rank, follower_rank):
        t.join(30)
    assert epochs == {0: conductor.epoch, 1: conductor.epoch}  # both ranks hold the same grant
    posts = {r: [p for m, p in c if m == "POST"] for r, c in calls.items()}
    assert posts[0] == ["/v1/trainer/request", "/v1/trainer/publish"]  # one request, one publish per pod
    assert posts[1] == []  # rank 1 only read the agent's state
    st = agent.state()
    assert st["stage"] == "Trained" and st["trainer"]["publishedVersion"] == "1"
