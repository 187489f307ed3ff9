"""The agent's guards through its action table (agent/actions.py check_leader, check_follower), as pure
functions: which command they refuse in which state, and why (each refusal stands for an SGLang call that
would kill the server or free nothing); and the stage moves the state store allows (agent/stages.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from rljob.agent.actions import ACTIONS, Actions, check_follower
from rljob.agent.actions import check_leader as check
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.errors import Refused
from rljob.agent.lease import LeaseDesk
from rljob.agent.metrics import AgentMetrics
from rljob.agent.operations import Operations
from rljob.agent.stages import BY_ACTION, IllegalMove, allowed
from rljob.agent.state import StateStore
from rljob.agent.transitions import refit_path
from rljob.api.agent import (
    Action,
    AgentState,
    Command,
    DrainCommand,
    GrantCommand,
    MemoryReport,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
    TrainerReport,
)
from rljob.api.spec import RefitSource, ReleaseTag

FACTS = SGLangFacts(
    version="0.5.23", weight_cache_mode="off", memory_saver=True, weights_cpu_backup=False, dp_size=1
)
ALL = [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS, ReleaseTag.CUDA_GRAPH]


def state(stage: Stage, **fields: object) -> AgentState:
    return AgentState.model_validate({"revision": 1, "bootId": "b", "stage": stage, **fields})


def command(action: Action) -> Command:
    return {
        Action.DRAIN: DrainCommand(epoch=1),
        Action.RELEASE: ReleaseCommand(epoch=1, tags=list(ALL)),
        Action.GRANT: GrantCommand(epoch=1),
        Action.REFIT: RefitCommand(epoch=1, version="1", path="/w/1"),
        Action.RESUME: ResumeCommand(epoch=1),
    }[action]


def refused(cmd: Command, st: AgentState, facts: SGLangFacts | None = FACTS) -> str:
    with pytest.raises(Refused) as err:
        check(cmd, st, facts)
    assert err.value.status == 409
    return err.value.error


# Stages in which a command is legal once its own guards hold (verified memory for a grant).
LIVE_STAGES = [s for s in Stage if s not in (Stage.STARTING, Stage.FAILED)]


@pytest.mark.parametrize("action", list(Action))
@pytest.mark.parametrize("stage", LIVE_STAGES)
def test_each_action_starts_only_from_its_stages(action: Action, stage: Stage) -> None:
    st = state(stage, memory=MemoryReport(verified=True))
    if stage in BY_ACTION[action].sources:
        check(command(action), st, FACTS)
    else:
        assert refused(command(action), st) == "IllegalTransition"


def test_the_stage_table() -> None:
    assert {
        Action.DRAIN: {Stage.READY, Stage.SERVING, Stage.DRAINED},
        Action.RELEASE: {Stage.DRAINED},
        Action.GRANT: {Stage.RELEASED},
        Action.REFIT: {Stage.TRAINED, Stage.READY, Stage.SERVING, Stage.DRAINED},
        Action.RESUME: {Stage.REFITTED, Stage.DRAINED, Stage.READY},
    } == {action: move.sources for action, move in BY_ACTION.items()}
    assert {action: row.move.to for action, row in ACTIONS.items()} == {
        Action.DRAIN: Stage.DRAINED,
        Action.RELEASE: Stage.RELEASED,
        Action.GRANT: Stage.GRANTED,
        Action.REFIT: Stage.REFITTED,
        Action.RESUME: Stage.SERVING,
    }


def test_the_store_moves_the_stage_only_by_a_declared_move() -> None:
    assert allowed(Stage.STARTING, Stage.READY) and allowed(Stage.GRANTED, Stage.TRAINED)
    assert allowed(Stage.SERVING, Stage.FAILED) and not allowed(Stage.FAILED, Stage.READY)
    assert not allowed(Stage.STARTING, Stage.SERVING) and not allowed(Stage.RELEASED, Stage.SERVING)
    store = StateStore()
    with store.change(stage=Stage.READY):
        pass
    revision = store.state.revision
    with pytest.raises(IllegalMove), store.change(stage=Stage.GRANTED):
        pass
    assert store.state.stage == Stage.READY and store.state.revision == revision  # nothing committed
    store.fail("SGLang exited")
    with pytest.raises(IllegalMove), store.change(stage=Stage.READY):
        pass
    assert store.state.stage == Stage.FAILED


@pytest.mark.parametrize("action", list(Action))
@pytest.mark.parametrize("stage", LIVE_STAGES)
def test_a_follower_checks_the_stage_order_and_its_own_record_only(action: Action, stage: Stage) -> None:
    st = state(stage, memory=MemoryReport(verified=True))
    if stage in BY_ACTION[action].sources:
        check_follower(command(action), st)  # no launch facts: the leader's guards are not a follower's
    else:
        with pytest.raises(Refused) as err:
            check_follower(command(action), st)
        assert err.value.error == "IllegalTransition"


def test_a_follower_refuses_a_second_release_and_an_unverified_grant() -> None:
    drained = state(Stage.DRAINED, releasedTags=["kv_cache"])
    for cmd, st, error in (
        (ReleaseCommand(epoch=1, tags=[ReleaseTag.KV_CACHE]), drained, "AlreadyReleased"),
        (ReleaseCommand(epoch=1, tags=[ReleaseTag.WEIGHTS, ReleaseTag.WEIGHTS]), drained, "DuplicateTag"),
        (GrantCommand(epoch=1), state(Stage.RELEASED), "NotVerified"),
        (DrainCommand(epoch=1), state(Stage.FAILED, fatal="gone"), "AgentFailed"),
        (DrainCommand(epoch=1), state(Stage.STARTING), "NotReady"),
    ):
        with pytest.raises(Refused) as err:
            check_follower(cmd, st)
        assert err.value.error == error, cmd


@pytest.mark.parametrize("action", list(Action))
def test_a_failed_agent_refuses_everything(action: Action) -> None:
    assert refused(command(action), state(Stage.FAILED, fatal="SGLang exited")) == "AgentFailed"


@pytest.mark.parametrize("action", list(Action))
def test_nothing_runs_before_sglang_answered(action: Action) -> None:
    assert refused(command(action), state(Stage.STARTING)) == "NotReady"
    assert refused(command(action), state(Stage.SERVING), facts=None) == "NotReady"


def test_release_guards() -> None:
    drained = state(Stage.DRAINED)
    twice = ReleaseCommand(epoch=1, tags=[ReleaseTag.KV_CACHE, ReleaseTag.KV_CACHE])
    assert refused(twice, drained) == "DuplicateTag"
    partly = state(Stage.DRAINED, releasedTags=["kv_cache"])
    assert refused(ReleaseCommand(epoch=1, tags=[ReleaseTag.KV_CACHE]), partly) == "AlreadyReleased"
    check(ReleaseCommand(epoch=1, tags=[ReleaseTag.WEIGHTS]), partly, FACTS)
    cached = replace(FACTS, weight_cache_mode="daemon")
    assert refused(ReleaseCommand(epoch=1, tags=list(ALL)), drained, cached) == "WeightCacheActive"
    check(ReleaseCommand(epoch=1, tags=[ReleaseTag.KV_CACHE]), drained, cached)  # weights stay put
    no_saver = replace(FACTS, memory_saver=False)
    assert refused(ReleaseCommand(epoch=1, tags=list(ALL)), drained, no_saver) == "MemorySaverDisabled"


def test_grant_needs_verified_memory() -> None:
    assert refused(GrantCommand(epoch=1), state(Stage.RELEASED)) == "NotVerified"
    check(GrantCommand(epoch=1), state(Stage.RELEASED, memory=MemoryReport(verified=True)), FACTS)


def test_refit_guards() -> None:
    trained = state(Stage.TRAINED, trainer=TrainerReport(published_version="1", published_path="/w/1"))
    cached = replace(FACTS, weight_cache_mode="daemon")
    assert refused(RefitCommand(epoch=1, version="1", path="/w/1"), trained, cached) == "WeightCacheActive"
    check(RefitCommand(epoch=1, version="1"), trained, FACTS)  # disk: the published path
    assert refused(RefitCommand(epoch=1, version="1"), state(Stage.READY)) == "NoPath"
    dp = replace(FACTS, dp_size=2)
    tensor = RefitCommand(epoch=1, version="1", source=RefitSource.TENSOR)
    assert refused(tensor, trained, dp) == "DataParallelUnsupported"
    check(tensor, trained, FACTS)
    check(RefitCommand(epoch=1, version="1", path="/w/1"), trained, dp)  # disk works with dp > 1


def test_refit_path_prefers_the_command_then_the_trainers_publication() -> None:
    trained = state(Stage.TRAINED, trainer=TrainerReport(published_version="1", published_path="/w/pub"))
    assert refit_path(RefitCommand(epoch=1, version="1", path="/w/cmd"), trained) == "/w/cmd"
    assert refit_path(RefitCommand(epoch=1, version="1"), trained) == "/w/pub"
    rejoin = state(Stage.READY, trainer=TrainerReport(published_version="1", published_path="/w/pub"))
    assert refit_path(RefitCommand(epoch=1, version="1"), rejoin) is None  # only a trained pod's own


def test_resume_of_released_weights_without_a_cpu_backup_is_refused() -> None:
    released = state(Stage.DRAINED, releasedTags=["weights"])
    assert refused(ResumeCommand(epoch=1), released) == "WeightsNotRefitted"
    backup = replace(FACTS, weights_cpu_backup=True)
    check(ResumeCommand(epoch=1), released, backup)
    check(ResumeCommand(epoch=1), state(Stage.DRAINED, releasedTags=["kv_cache"]), FACTS)
    check(ResumeCommand(epoch=1), state(Stage.REFITTED), FACTS)


class _NoGpus:
    async def sample(self) -> list[object]:
        return []


def test_a_command_commits_its_record_and_its_move_in_one_revision() -> None:
    """Actions.execute: the row's record (the grant's lease) and its move (to Granted) in one revision."""

    async def grant() -> list[tuple[int, Stage, bool]]:
        seen: list[tuple[int, Stage, bool]] = []
        store = StateStore(
            on_commit=lambda r: seen.append((r, store.state.stage, store.state.trainer.lease_held))
        )
        store.state = state(Stage.RELEASED, memory=MemoryReport(verified=True))
        ops = Operations(store, None, _NoGpus(), None, LeaseDesk(store), AgentMetrics(), 1.0)  # type: ignore[arg-type]
        actions = Actions.leader(ops)
        actions.check(GrantCommand(epoch=2), store.state, FACTS)
        await actions.execute(GrantCommand(epoch=2))
        return seen

    seen = asyncio.run(grant())
    assert seen[0] == (2, Stage.GRANTED, True), seen
