"""The guards of each command action (their rows: agent/actions.py) that keep SGLang alive (the invariants
of docs/lifecycle.md). Pure functions of the state: a refusal here means nothing was sent to SGLang."""

from __future__ import annotations

from rljob.agent.engines.base import EngineFacts
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.errors import conflict, forbidden_by_launch
from rljob.agent.stages import BY_ACTION
from rljob.api.agent import (
    AgentState,
    Command,
    DrainCommand,
    GrantCommand,
    GroupState,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
)
from rljob.api.spec import DrainMode, RefitSource, ReleaseTag


def refit_path(cmd: RefitCommand, state: AgentState) -> str | None:
    """The checkpoint a disk refit loads: the command's path, else what the trainer published."""
    if cmd.path:
        return cmd.path
    return state.trainer.published_path if state.stage == Stage.TRAINED else None


def leader_ready(state: AgentState, facts: EngineFacts | None) -> None:
    """Refused while no command may run on the leader, whatever the action."""
    if state.stage == Stage.FAILED:
        raise conflict("AgentFailed", f"the pod must be replaced: {state.fatal}")
    if state.stage == Stage.STARTING or facts is None:
        raise conflict("NotReady", "SGLang has not answered /server_info yet")
    if state.trainer.weights_group == GroupState.PENDING:
        # C-REFIT-GROUP-BLOCK: any other control call would queue behind the blocking group init.
        raise conflict("Busy", "init_weights_update_group is still waiting for the trainer to join the group")
    if _sglang(facts).dp_attention:
        raise forbidden_by_launch(
            "DataParallelAttentionUnsupported",
            "SGLang runs --enable-dp-attention: control messages go to every tp_size-th worker "
            "(C-DP-FANOUT) and the per-rank idle proof is not known to hold there, so the agent does not "
            "pause, release or refit it. Launch SGLang without --enable-dp-attention.",
        )


def follower_ready(state: AgentState) -> None:
    """Refused while no command may run on a follower, whatever the action."""
    if state.stage == Stage.FAILED:
        raise conflict("AgentFailed", f"the pod must be replaced: {state.fatal}")
    if state.stage == Stage.STARTING:
        raise conflict("NotReady", "SGLang's /ping has not answered yet")


def stage_allows(cmd: Command, state: AgentState) -> None:
    allowed = BY_ACTION[cmd.action].sources
    if state.stage not in allowed:
        raise conflict(
            "IllegalTransition",
            f"{cmd.action.value} is not allowed in stage {state.stage.value} "
            f"(only from {', '.join(sorted(s.value for s in allowed))})",
        )


def no_guard(cmd: Command, state: AgentState, facts: EngineFacts) -> None:
    """An action whose SGLang calls need no launch or version guard."""


def release_bookkeeping(cmd: ReleaseCommand, state: AgentState) -> None:
    if len(set(cmd.tags)) != len(cmd.tags):
        # Harmless to SGLang (a set, C-MEM-DUP-TAG-RELEASE), but a malformed command: say so.
        raise conflict("DuplicateTag", "a tag appears twice in one release")
    again = [t.value for t in cmd.tags if t in state.released_tags]
    if again:
        raise conflict(
            "AlreadyReleased", f"already released: {', '.join(again)} (a second release kills SGLang)"
        )


def grant_bookkeeping(cmd: GrantCommand, state: AgentState) -> None:
    if not state.memory.verified:
        raise conflict("NotVerified", "freed GPU memory was not verified on every GPU")


def no_bookkeeping(cmd: Command, state: AgentState) -> None:
    """An action whose legality is its stage alone."""


def drain_guards(cmd: DrainCommand, state: AgentState, facts: EngineFacts) -> None:
    facts = _sglang(facts)
    if cmd.mode != DrainMode.RETRACT:
        return
    quirks = SGLangQuirks.detect(facts.version)
    if not quirks.release_ignores_waiting_when_retracted:
        raise forbidden_by_launch(
            "RetractUnsupported",
            f"SGLang {facts.version} counts retracted (waiting) requests as work in its flush and release "
            "checks (C-IDLE-RELEASE): after a "
            "retract with requests in flight it never becomes idle, and a release or a flushing refit "
            "would kill it. Set spec.rollout.drain.mode: abort (0.5.9-0.5.20), or run SGLang 0.5.21+.",
        )
    if facts.dp_size > 1 and quirks.loads_frozen_while_paused:
        raise forbidden_by_launch(
            "RetractUnsupported",
            f"SGLang {facts.version} runs --dp-size {facts.dp_size}: after a retract its schedulers stay "
            "paused and never republish their load snapshots (C-DP-LOADS-PAUSED), so no rank can be proven "
            "idle and a release would be sent blind. Set spec.rollout.drain.mode: abort, or run --dp-size 1.",
        )


def release_guards(cmd: ReleaseCommand, state: AgentState, facts: EngineFacts) -> None:
    facts = _sglang(facts)
    if ReleaseTag.WEIGHTS in cmd.tags and facts.weight_cache_active:
        raise forbidden_by_launch(
            "WeightCacheActive",
            f"SGLang runs --weight-cache-mode {facts.weight_cache_mode}: releasing weights kills it. "
            "Launch SGLang with --weight-cache-mode off.",
        )
    if not facts.memory_saver:
        raise forbidden_by_launch(
            "MemorySaverDisabled",
            "SGLang runs without --enable-memory-saver: release frees nothing. Launch SGLang with "
            "--enable-memory-saver.",
        )


def refit_guards(cmd: RefitCommand, state: AgentState, facts: EngineFacts) -> None:
    facts = _sglang(facts)
    if facts.weight_cache_active:
        raise forbidden_by_launch(
            "WeightCacheActive",
            f"SGLang runs --weight-cache-mode {facts.weight_cache_mode}: every refit kills it. Launch "
            "SGLang with --weight-cache-mode off.",
        )
    if cmd.source == RefitSource.DISK and not cmd.reload and refit_path(cmd, state) is None:
        raise conflict(
            "NoPath", "disk refit needs a path: none in the command and none published by the trainer"
        )
    if cmd.source != RefitSource.DISK and facts.dp_size > 1:
        raise forbidden_by_launch(
            "DataParallelUnsupported",
            f"{cmd.source.value} refit is not supported with dp_size > 1 (C-REFIT-DP). Set "
            "spec.refit.source: disk, or run --dp-size 1.",
        )


def resume_guards(cmd: ResumeCommand, state: AgentState, facts: EngineFacts) -> None:
    facts = _sglang(facts)
    if (
        state.stage == Stage.DRAINED
        and ReleaseTag.WEIGHTS in state.released_tags
        and not facts.weights_cpu_backup
    ):
        raise conflict(
            "WeightsNotRefitted",
            "weights were released without CPU backup: their contents are garbage until a refit",
        )


def _sglang(facts: EngineFacts) -> SGLangFacts:
    assert isinstance(facts, SGLangFacts), facts
    return facts
