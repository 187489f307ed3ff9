"""vLLM's guards as pure functions (agent/engines/vllm/guards.py): the refusals no command of the
agent-tier tests can reach through the stage order, and the supported versions."""

from __future__ import annotations

import pytest

from rljob.agent.engines.vllm.facts import VLLMFacts
from rljob.agent.engines.vllm.guards import VLLMGuards
from rljob.agent.engines.vllm.quirks import SUPPORTED, VLLMQuirks
from rljob.agent.errors import Refused
from rljob.api.agent import AgentState, ReleaseCommand, ResumeCommand, Stage
from rljob.api.spec import ReleaseTag

TAGS = [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS]


def facts(version: str = "0.34.0", *, sleep_mode: bool = True, **kw: object) -> VLLMFacts:
    return VLLMFacts(version, True, sleep_mode, **kw)  # type: ignore[arg-type]


def test_a_second_sleep_while_a_part_sleeps_is_refused() -> None:
    """V-KILL-SLEEP-TWICE: 0.26 skips a sleep while any part sleeps, 0.34 while weights sleep: silent."""
    state = AgentState(revision=1, boot_id="b", stage=Stage.DRAINED, released_tags=[ReleaseTag.KV_CACHE])
    with pytest.raises(Refused) as refused:
        VLLMGuards().release(ReleaseCommand(epoch=2, tags=TAGS), state, facts())
    assert refused.value.error == "AlreadyAsleep" and not refused.value.permanent


def test_a_drained_pod_with_discarded_weights_is_not_resumed() -> None:
    state = AgentState(revision=1, boot_id="b", stage=Stage.DRAINED, released_tags=TAGS)
    with pytest.raises(Refused) as refused:
        VLLMGuards().resume(ResumeCommand(epoch=2), state, facts())
    assert refused.value.error == "WeightsNotRefitted"
    VLLMGuards().resume(ResumeCommand(epoch=2), state, facts(keep_weights=True))  # level 1: kept


def test_only_the_recorded_versions_are_driven() -> None:
    assert SUPPORTED == ("0.26.0", "0.34.0")
    assert all(VLLMQuirks.detect(v).is_supported for v in SUPPORTED)
    for other in ("0.25.1", "0.27.0", "0.33.2", "0.35.0"):
        assert not VLLMQuirks.detect(other).is_supported, other


def test_each_launch_refusal_names_what_to_change() -> None:
    assert facts(sleep_mode=False).launch_refusal is not None
    refusal = facts(sleep_mode=False).launch_refusal
    assert refusal is not None and "--enable-sleep-mode" in refusal.message
    exposed = facts(insecure_serialization=True, exposed_at="10.0.0.7:8000").launch_refusal
    assert exposed is not None and "--host 127.0.0.1" in exposed.message
    assert facts(insecure_serialization=True).launch_refusal is None  # on loopback only: safe
