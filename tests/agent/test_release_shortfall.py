"""Release verification that can never pass is a permanent failure (the job fails, no gang restart);
memory that is still being freed is not (slime#579: a restart may well succeed)."""

from __future__ import annotations

from collections.abc import Callable

from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator

GiB = 1 << 30
CUDA_GRAPH_IN_SAVER = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}  # makes the cuda_graph tag free memory
# With that variable the default (breakable) prefill graph backend refuses to start (C-MEM-CUDAGRAPH-ENV).
NO_PREFILL_GRAPH = ("--cuda-graph-backend-prefill", "disabled")


def test_tags_that_cannot_free_enough_fail_permanently_with_freed_and_needed_per_gpu(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    # 2 GiB of CUDA graphs on each GPU, 60 GiB used: releasing only cuda_graph frees 1/30, not 1/2.
    emu = start_emulator("0.5.23", "--gpus", "2", *NO_PREFILL_GRAPH, env=CUDA_GRAPH_IN_SAVER)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    st = c.failed("release", tags=["cuda_graph"], verify={"minFreedFraction": 0.5, "timeoutSeconds": 2})
    assert st["permanent"] is True and st["failureReason"] == "ReleaseShortfall", st
    used = 2 * GiB + 16 * GiB + 40 * GiB + 2 * GiB  # the emulator's baseline + weights + kv + graphs
    for gpu in (0, 1):
        assert f"GPU {gpu} freed {2 * GiB} of {used // 2} bytes" in st["error"], st["error"]
    assert "releasing cuda_graph cannot free what verify asks" in st["error"]
    state = agent.state()
    assert state["stage"] == "Drained" and not state["memory"]["verified"]
    c.refused("grant", "IllegalTransition", _emulator_url=emu.url)  # the trainer never gets the GPU


def test_a_shortfall_after_a_delayed_unmap_is_still_permanent_once_it_stops_moving(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(
        "0.5.23", "--fault-release-unmap-delay", "0.5", *NO_PREFILL_GRAPH, env=CUDA_GRAPH_IN_SAVER
    )
    c = AgentDriver(start_agent(emu))
    c.ok("drain")
    st = c.failed("release", tags=["cuda_graph"], verify={"minFreedFraction": 0.5, "timeoutSeconds": 3})
    assert st["permanent"] is True and st["failureReason"] == "ReleaseShortfall", st
    assert f"GPU 0 freed {2 * GiB} of" in st["error"]


def test_a_delayed_unmap_that_completes_succeeds(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--gpus", "2", "--fault-release-unmap-delay", "1.5")
    c = AgentDriver(start_agent(emu))
    c.ok("drain")
    st = c.ok("release", tags=ALL_TAGS, verify={"minFreedFraction": 0.5, "timeoutSeconds": 10})
    assert st["permanent"] is False and st.get("failureReason") is None, st
    assert st["seconds"] >= 1.4  # it did wait for the unmap


def test_an_unmap_not_yet_visible_at_the_deadline_stays_retryable(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """Nothing freed yet is no evidence that the tags cannot free enough: the gang may be restarted."""
    emu = start_emulator("0.5.23", "--fault-release-unmap-delay", "30")
    c = AgentDriver(start_agent(emu))
    c.ok("drain")
    st = c.failed("release", tags=ALL_TAGS, verify={"timeoutSeconds": 1})
    assert st["permanent"] is False and st.get("failureReason") is None, st
    assert "release not verified within 1s: GPU 0 freed 0 of" in st["error"]
