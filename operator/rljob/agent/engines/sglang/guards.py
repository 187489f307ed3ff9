"""What SGLang's version and launch flags forbid the handoff (agent/engines/base.py EngineGuards): each
refusal stands for a call that would kill SGLang, or free nothing, or leave it in a state the agent cannot
prove. Pure functions of the state and the facts: a refusal means nothing was sent."""

from __future__ import annotations

import base64
import binascii

from rljob.agent.engines.base import EngineFacts
from rljob.agent.engines.sglang import bucket_check
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.errors import Refused, conflict, forbidden_by_launch
from rljob.api.agent import (
    AgentState,
    DistributedPush,
    DrainCommand,
    GroupState,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
    TensorPush,
)
from rljob.api.spec import DrainMode, RefitSource, ReleaseTag


class SGLangGuards:
    def leader_ready(self, state: AgentState, facts: EngineFacts) -> None:
        if state.trainer.weights_group == GroupState.PENDING:
            # C-REFIT-GROUP-BLOCK: any other control call would queue behind the blocking group init.
            raise conflict(
                "Busy", "init_weights_update_group is still waiting for the trainer to join the group"
            )
        if _own(facts).dp_attention:
            raise forbidden_by_launch(
                "DataParallelAttentionUnsupported",
                "SGLang runs --enable-dp-attention: control messages go to every tp_size-th worker "
                "(C-DP-FANOUT) and the per-rank idle proof is not known to hold there, so the agent does not "
                "pause, release or refit it. Launch SGLang without --enable-dp-attention.",
            )

    def drain(self, cmd: DrainCommand, state: AgentState, facts: EngineFacts) -> None:
        if cmd.mode == DrainMode.WAIT:
            raise forbidden_by_launch(
                "DrainModeUnsupported",
                "SGLang has no pause that lets running requests finish while it takes no new ones: its "
                "pause_generation aborts, retracts or keeps them in place (the last kills a later release). "
                "Set spec.rollout.drain.mode: abort or retract.",
            )
        if cmd.mode != DrainMode.RETRACT:
            return
        f = _own(facts)
        quirks = SGLangQuirks.detect(f.version)
        if not quirks.release_ignores_waiting_when_retracted:
            raise forbidden_by_launch(
                "RetractUnsupported",
                f"SGLang {f.version} counts retracted (waiting) requests as work in its flush and release "
                "checks (C-IDLE-RELEASE): after a "
                "retract with requests in flight it never becomes idle, and a release or a flushing refit "
                "would kill it. Set spec.rollout.drain.mode: abort (0.5.9-0.5.20), or run SGLang 0.5.21+.",
            )
        if f.dp_size > 1 and quirks.loads_frozen_while_paused:
            raise forbidden_by_launch(
                "RetractUnsupported",
                f"SGLang {f.version} runs --dp-size {f.dp_size}: after a retract its schedulers stay "
                "paused and never republish their load snapshots (C-DP-LOADS-PAUSED), so no rank can be "
                "proven idle and a release would be sent blind. Set spec.rollout.drain.mode: abort, or run "
                "--dp-size 1.",
            )

    def release(self, cmd: ReleaseCommand, state: AgentState, facts: EngineFacts) -> None:
        f = _own(facts)
        if ReleaseTag.WEIGHTS in cmd.tags and f.weight_cache_active:
            raise forbidden_by_launch(
                "WeightCacheActive",
                f"SGLang runs --weight-cache-mode {f.weight_cache_mode}: releasing weights kills it. "
                "Launch SGLang with --weight-cache-mode off.",
            )
        if not f.memory_saver:
            raise forbidden_by_launch(
                "MemorySaverDisabled",
                "SGLang runs without --enable-memory-saver: release frees nothing. Launch SGLang with "
                "--enable-memory-saver.",
            )

    def refit(self, cmd: RefitCommand, state: AgentState, facts: EngineFacts) -> None:
        f = _own(facts)
        if f.weight_cache_active:
            raise forbidden_by_launch(
                "WeightCacheActive",
                f"SGLang runs --weight-cache-mode {f.weight_cache_mode}: every refit kills it. Launch "
                "SGLang with --weight-cache-mode off.",
            )
        if cmd.source != RefitSource.DISK and f.dp_size > 1:
            raise forbidden_by_launch(
                "DataParallelUnsupported",
                f"{cmd.source.value} refit is not supported with dp_size > 1 (C-REFIT-DP). Set "
                "spec.refit.source: disk, or run --dp-size 1.",
            )

    def resume(self, cmd: ResumeCommand, state: AgentState, facts: EngineFacts) -> None:
        if (
            state.stage == Stage.DRAINED
            and ReleaseTag.WEIGHTS in state.released_tags
            and not _own(facts).weights_cpu_backup
        ):
            raise conflict(
                "WeightsNotRefitted",
                "weights were released without CPU backup: their contents are garbage until a refit",
            )

    def tensor_push(self, push: TensorPush, facts: EngineFacts | None = None) -> int:
        """What SGLang's scheduler would die on in a tensor push, checked before it is forwarded; the
        bytes it carries."""
        if push.update_info is not None:
            raise Refused(
                422,
                "InvalidPush",
                "updateInfo is not SGLang's form: SGLang takes serializedNamedTensors; nothing was sent",
            )
        payloads = [_decoded(i, text) for i, text in enumerate(push.serialized_named_tensors)]
        for i, payload in enumerate(payloads):
            _check_readable(i, payload, push.load_format)
        return sum(map(len, payloads))

    def weights_group(self, facts: EngineFacts | None) -> None:
        if facts is not None and facts.dp_size > 1:  # a distributed window is refused first; kept explicit
            raise conflict("DataParallelUnsupported", "init_weights_update_group is refused with dp_size > 1")

    def distributed_push(self, push: DistributedPush, formed: set[str], facts: EngineFacts | None) -> None:
        quirks = SGLangQuirks.detect(facts.version) if facts is not None else None
        if push.group_name not in formed and (quirks is None or quirks.unknown_weights_group_is_fatal):
            raise conflict(  # C-REFIT-GROUP-UNKNOWN: this SGLang dies on a group it never formed
                "UnknownWeightsGroup",
                f"groupName {push.group_name!r} was not formed through this agent (formed: "
                f"{sorted(formed) or 'none'}); POST /v1/trainer/refit/group and wait for group: Ready first; "
                "nothing was sent",
            )


def _own(facts: EngineFacts) -> SGLangFacts:
    """SGLang's guards read SGLang's facts (the registry picks the guards by the facts' kind)."""
    assert isinstance(facts, SGLangFacts), facts
    return facts


def _decoded(i: int, text: str) -> bytes:
    try:  # C-REFIT-TENSOR-B64: fatal on 0.5.6
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise Refused(
            422, "InvalidPush", f"serializedNamedTensors[{i}] is not base64 ({e}); nothing was sent"
        ) from e


def _check_readable(i: int, payload: bytes, load_format: str | None) -> None:
    obj, broken = bucket_check.read(payload)  # once: a bucket's pickle names ~40 entries
    if broken is not None:  # C-REFIT-TENSOR-PICKLE: fatal on every version
        raise Refused(
            422,
            "InvalidPush",
            f"serializedNamedTensors[{i}] is not a pickle SGLang can read ({broken}): SGLang would die; "
            "nothing was sent",
        )
    missing = bucket_check.missing_in(obj) if load_format == "flattened_bucket" else None
    if missing is not None:  # C-REFIT-TENSOR-META: fatal on every version
        raise Refused(
            422,
            "InvalidPush",
            f"serializedNamedTensors[{i}].{missing} is missing: SGLang reads it and would die; "
            "nothing was sent",
        )
