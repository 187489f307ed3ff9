"""What vLLM's version and launch forbid the handoff (agent/engines/base.py EngineGuards): each refusal
stands for a call that would kill vLLM, hang it, free nothing, or make it serve garbage
(docs/vllm-conformance.md §7). Pure functions of the state and the facts: a refusal means nothing was
sent."""

from __future__ import annotations

import math
from typing import Any

from rljob.agent.engines.base import EngineFacts
from rljob.agent.engines.vllm import handles
from rljob.agent.engines.vllm.facts import VLLMFacts
from rljob.agent.errors import Refused, conflict, forbidden_by_launch
from rljob.api.agent import (
    AgentState,
    DistributedPush,
    DrainCommand,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
    TensorPush,
)
from rljob.api.spec import RefitSource, ReleaseTag

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1, "int32": 4,
            "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip
UPDATE_FIELDS = frozenset({"names", "dtype_names", "shapes", "ipc_handles_pickled", "tensor_sizes"})
DISTRIBUTED = (
    "vLLM's NCCL weight transfer needs the trainer to join through vLLM's own sender "
    "(NCCLWeightTransferEngine.trainer_init, trainer_send_weights: a StatelessProcessGroup and a PyNccl "
    "communicator, V-REFIT-NCCL), which the SDK does not speak, and its update blocks the engine core "
    "with no bound until the trainer broadcasts (V-KILL-NCCL-ALONE, V-HANG). Set spec.refit.source: "
    "tensor (CUDA IPC) or disk."
)


class VLLMGuards:
    def leader_ready(self, state: AgentState, facts: EngineFacts) -> None:
        f = _own(facts)
        if not f.dev_mode:
            raise forbidden_by_launch(
                "LifecycleRoutesDisabled",
                "vLLM runs without VLLM_SERVER_DEV_MODE=1: it has no pause, sleep, wake or weight route "
                "(V-LAUNCH-DEVMODE). Set VLLM_SERVER_DEV_MODE=1 in vLLM's environment.",
            )

    def drain(self, cmd: DrainCommand, state: AgentState, facts: EngineFacts) -> None:
        """Every mode maps to a pause mode (abort, keep with clear_cache, wait: §8)."""

    def release(self, cmd: ReleaseCommand, state: AgentState, facts: EngineFacts) -> None:
        f = _own(facts)
        tags = set(cmd.tags)
        if not f.sleep_mode:
            raise forbidden_by_launch(
                "ReleaseFreesNothing",
                "vLLM runs without --enable-sleep-mode: a sleep answers 200 and frees nothing "
                "(V-KILL-NO-SLEEP-MODE). Launch vLLM with --enable-sleep-mode.",
            )
        if ReleaseTag.CUDA_GRAPH in tags:
            raise forbidden_by_launch(
                "ReleaseTagUnsupported",
                "vLLM's CUDA graphs live outside its sleep allocator and stay on the GPU (V-MEM-RESIDENT): "
                "cuda_graph cannot be released. Set spec.release.tags: [kv_cache, weights] or [kv_cache].",
            )
        if tags == {ReleaseTag.WEIGHTS}:
            raise forbidden_by_launch(
                "ReleaseTagUnsupported",
                "vLLM has no route that releases its weights without the KV cache (V-MEM-RELEASE-KV). "
                "Set spec.release.tags: [kv_cache, weights].",
            )
        if tags == {ReleaseTag.KV_CACHE} and not f.quirks.releases_kv_alone:
            raise forbidden_by_launch(
                "ReleaseTagUnsupported",
                f"vLLM {f.version} releases the KV cache only with the weights (/sleep; "
                "/release_kv_cache_memory exists from 0.34.0, V-MEM-RELEASE-KV). Set spec.release.tags: "
                "[kv_cache, weights].",
            )
        if state.released_tags:
            # V-KILL-SLEEP-TWICE: a second sleep while a part sleeps frees nothing it should (silent).
            raise conflict(
                "AlreadyAsleep",
                f"vLLM still sleeps {', '.join(t.value for t in state.released_tags)}: a second sleep "
                "skips what it should free (V-MEM-SLEEP-TWICE); resume first",
            )

    def refit(self, cmd: RefitCommand, state: AgentState, facts: EngineFacts) -> None:
        f = _own(facts)
        if cmd.source == RefitSource.DISTRIBUTED:
            raise forbidden_by_launch("DistributedRefitUnsupported", DISTRIBUTED)
        if cmd.source == RefitSource.TENSOR:
            why = f.tensor_refit_impossible()
            if why is not None:
                raise forbidden_by_launch("TensorTransferUnconfigured", why)

    def resume(self, cmd: ResumeCommand, state: AgentState, facts: EngineFacts) -> None:
        """V-KILL-L2-NO-REFIT: a level-2 sleep discarded the weights; a resume wakes them as fresh memory and
        the last wake resumes scheduling on it (V-MEM-WAKE-ORDER): garbage tokens."""
        if (
            state.stage == Stage.DRAINED
            and ReleaseTag.WEIGHTS in state.released_tags
            and not _own(facts).weights_survive_release
        ):
            raise conflict(
                "WeightsNotRefitted",
                "vLLM slept at level 2: its weights come back as fresh memory of undefined contents "
                "(V-KILL-L2-NO-REFIT); refit before resuming",
            )

    def tensor_push(self, push: TensorPush, facts: EngineFacts | None = None) -> int:
        """What vLLM would fail on after the update's start (its layers then stay unbuilt, and the next
        forward kills it: V-KILL-REFIT-FAILED), checked before it is forwarded; the bytes it carries."""
        f = _own(facts) if facts is not None else None
        info = push.update_info
        if info is None:
            raise _invalid("serializedNamedTensors is not vLLM's form: vLLM takes updateInfo")
        unknown = sorted(set(info) - UPDATE_FIELDS - {"packed"})
        if unknown:
            raise _invalid(f"updateInfo has fields vLLM's IPC update does not take: {', '.join(unknown)}")
        if "packed" in info and info["packed"] is not True:
            raise _invalid("updateInfo.packed: the agent drives vLLM's packed IPC transfer only (one buffer)")
        names, dtypes, shapes, sizes = (
            info.get(k) for k in ("names", "dtype_names", "shapes", "tensor_sizes")
        )
        for key, value in (
            ("names", names),
            ("dtype_names", dtypes),
            ("shapes", shapes),
            ("tensor_sizes", sizes),
        ):
            if not isinstance(value, list) or not value:
                raise _invalid(f"updateInfo.{key} must be a non-empty list")
        assert isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
        assert isinstance(sizes, list)
        if not len(names) == len(dtypes) == len(shapes) == len(sizes):
            raise _invalid(
                "updateInfo.names, dtype_names, shapes and tensor_sizes must have the same length "
                f"({len(names)}, {len(dtypes)}, {len(shapes)}, {len(sizes)})"
            )
        for i, (name, dtype, shape, size) in enumerate(zip(names, dtypes, shapes, sizes, strict=True)):
            _check_entry(i, name, dtype, shape, size)
        args = _handles(info.get("ipc_handles_pickled"), f)
        total = sum(int(s) for s in sizes)
        for uuid, a in args.items():
            held = handles.storage_bytes(a)
            if held is not None and held < total:
                raise _invalid(
                    f"the buffer on {uuid} holds {held} bytes and tensor_sizes add up to {total}: vLLM would "
                    "read past it"
                )
        return total

    def weights_group(self, facts: EngineFacts | None) -> None:
        raise forbidden_by_launch("DistributedRefitUnsupported", DISTRIBUTED)

    def distributed_push(self, push: DistributedPush, formed: set[str], facts: EngineFacts | None) -> None:
        raise forbidden_by_launch("DistributedRefitUnsupported", DISTRIBUTED)


def _own(facts: EngineFacts | None) -> VLLMFacts:
    """vLLM's guards read vLLM's facts (the registry picks the guards by the facts' kind)."""
    assert isinstance(facts, VLLMFacts), facts
    return facts


def _invalid(why: str) -> Refused:
    return Refused(422, "InvalidPush", f"{why}; a failed update leaves vLLM's layers unbuilt "
                   "(V-KILL-REFIT-FAILED): nothing was sent")  # fmt: skip


def _check_entry(i: int, name: Any, dtype: Any, shape: Any, size: Any) -> None:
    if not isinstance(name, str) or not name:
        raise _invalid(f"updateInfo.names[{i}] is not a name")
    if dtype not in ITEMSIZE:
        raise _invalid(
            f"updateInfo.dtype_names[{i}] = {dtype!r} is not a torch dtype name vLLM views bytes as"
        )
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _invalid(f"updateInfo.shapes[{i}] is not a list of sizes")
    want = math.prod(shape) * ITEMSIZE[dtype]
    if not isinstance(size, int) or size != want:
        raise _invalid(
            f"updateInfo.tensor_sizes[{i}] = {size!r}, but {name} is {shape} of {dtype}: {want} bytes "
            "(vLLM views each slice as its shape)"
        )


def _handles(text: Any, facts: VLLMFacts | None) -> dict[str, tuple[Any, ...]]:
    obj, broken = handles.decode(text)
    if broken is not None:
        raise _invalid(f"updateInfo.ipc_handles_pickled is {broken}")
    args = handles.native(obj)
    if args is None or obj != args:
        raise _invalid(
            "updateInfo.ipc_handles_pickled is not one packed buffer's handles {gpu_uuid: "
            "rebuild_cuda_tensor args} (V-REFIT-IPC)"
        )
    not_bytes = sorted(uuid for uuid, a in args.items() if a[5] != handles.UINT8)
    if not_bytes:
        raise _invalid(
            f"the packed buffer on {', '.join(not_bytes)} is not uint8: vLLM cuts and splits it by the byte "
            "sizes in tensor_sizes (packed_tensor.py:19-46,423-430@0.26.0)"
        )
    workers = facts.world_size if facts is not None else 1
    if len(args) < workers:
        raise _invalid(
            f"vLLM runs {workers} workers and each opens the handle of its own GPU (V-REFIT-IPC); the push "
            f"has handles for {len(args)} GPU(s)"
        )
    return args
