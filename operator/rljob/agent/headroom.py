"""The headroom gate: a resume is sent to the engine only once every GPU of the pod has free what it takes
back.

A resume whose memory another process holds may kill the engine (it cannot map the region again). Before
each resume (weights and cuda_graph in the refit,
kv_cache in the resume) the agent checks on the GPU probe, per GPU, that free memory covers the resume's
need plus RESUME_MARGIN_BYTES. If not, it does not send the call: it says who holds the memory (NVML's
per-process list, agent/gpu_holders.py) in its state (`AgentState.headroom`, which the operator puts in
the RLJob's status message and a ResumeWaitingForMemory event), re-checks with backoff, and resumes once
the memory is free; at the command's deadline the command fails with that reason, the engine alive and
paused.

A resume's need, per GPU: what the cycle's release freed on that GPU (the release verification measured
it), less what the resumes since took back (measured on the probe around each), and no more than the size
the engine reports for the parts it resumes (EngineFacts.tag_bytes, read at start) where it reports all of
them. One release call frees every part at once, so NVML alone cannot tell how much of it the weights take
back and how much the KV cache: without the engine's sizes the refit's resume of weights waits for room for
everything released.

Whether or not the resume waits, a trainer process that still holds more than TRAINER_NOTICE_BYTES on a
GPU of the pod after returning its lease is named (`ResumeHeadroom.trainer_held`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from rljob.agent.errors import CommandFailed
from rljob.agent.gpu_holders import attribute, describe, gib, trainer_container
from rljob.agent.gpu_probe import GpuMemory, GpuProbe
from rljob.agent.state import StateStore
from rljob.api.agent import GpuHeadroom, GpuProcess, ResumeHeadroom
from rljob.api.spec import ReleaseTag

log = logging.getLogger("rljob.agent")

# An engine's size report leaves out what cuMemCreate rounds each of its allocations up to (2 MiB each, a few
# hundred of them), NVML's used moves by tens of MiB on its own, and the driver maps with some room free.
RESUME_MARGIN_BYTES = 512 << 20
FIRST_RECHECK_S, MAX_RECHECK_S = 0.05, 2.0  # re-checks back off to one every 2 s: NVML costs ~1 ms each
TRAINER_NOTICE_BYTES = 1 << 30  # a CUDA context with cuBLAS and NCCL workspaces stays below; more was kept
MAX_HOLDERS_SHOWN = 4  # per GPU in the message
MAX_GPUS_REPORTED = 64

Sampler = Callable[[], Awaitable[list[GpuMemory]]]
PROC = Path("/proc")


class HeadroomGate:
    def __init__(self, store: StateStore, probe: GpuProbe, sample: Sampler, proc_root: Path = PROC) -> None:
        self.store = store
        self.probe = probe
        self._sample = sample  # Operations._sample: its errors fail the command (nothing is sent unchecked)
        self.proc_root = proc_root  # where the pod's processes are seen (agent/gpu_holders.py)

    def need(self, tags: list[ReleaseTag]) -> dict[int, int]:
        """Per GPU, the bytes resuming `tags` maps again ({} when nothing is known to gate on)."""
        store = self.store
        sizes = dict(store.facts.tag_bytes) if store.facts is not None else {}
        cap = sum(sizes[t.value] for t in tags) if all(t.value in sizes for t in tags) else None
        remaining = {i: max(0, f - store.taken_back.get(i, 0)) for i, f in store.release_freed.items()}
        if cap is None:
            return remaining
        return {i: min(r, cap) for i, r in remaining.items()}

    async def clear(
        self, tags: list[ReleaseTag], epoch: int, deadline: Callable[[], float]
    ) -> list[GpuMemory]:
        """Returns once every GPU has the resume's need free (the probe's last sample); CommandFailed at the
        deadline (`deadline()`: seconds left) with who holds the memory."""
        need = self.need(tags)
        if not need:
            log.warning("resume of %s: no release measured on this pod, nothing to gate on", _names(tags))
        loop = asyncio.get_running_loop()
        started, pause, last = loop.time(), FIRST_RECHECK_S, ""
        while True:
            gpus = await self._sample()
            free = {g.index: max(0, g.total_bytes - g.used_bytes) for g in gpus}
            short = [i for i in sorted(need) if free.get(i, 0) < need[i] + RESUME_MARGIN_BYTES]
            processes, unlisted = await self._processes()
            waited = loop.time() - started if last else 0.0  # since the first check found it short
            if not short:
                self._report(tags, epoch, need, free, [], processes, None, False, waited)
                if last:
                    log.info("resume of %s: GPU memory free after %.1fs", _names(tags), waited)
                return gpus
            holders = [p for p in processes if p.gpu in short]
            message = shortfall(tags, short, need, free, holders, unlisted)
            left = deadline()
            if left <= 0:
                self._report(tags, epoch, need, free, holders, processes, message, False, waited)
                raise CommandFailed(f"{message}; not resumed: not free within the command's deadline")
            if message != last:
                log.warning("resume of %s waits for GPU memory: %s", _names(tags), message)
                self._report(tags, epoch, need, free, holders, processes, message, True, waited)
                last = message
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, MAX_RECHECK_S)

    def took_back(self, before: list[GpuMemory], after: list[GpuMemory]) -> None:
        """A resume answered: what it mapped on each GPU counts against the next resume of the cycle."""
        used = {g.index: g.used_bytes for g in before}
        for g in after:
            if g.index in used:
                grew = max(0, g.used_bytes - used[g.index])
                self.store.taken_back[g.index] = self.store.taken_back.get(g.index, 0) + grew

    async def _processes(self) -> tuple[list[GpuProcess], str | None]:
        """NVML's process list on the pod's GPUs, attributed; ([], why) when the probe cannot list them."""
        listing = getattr(self.probe, "processes", None)
        if listing is None:
            return [], "the GPU probe lists no processes"
        try:
            listed = await listing()
        except Exception as e:  # NVML's errors have no common base; the figures alone still gate
            return [], f"processes not listed: {e.__class__.__name__}: {e}"
        return attribute(listed, bool(getattr(self.probe, "host_pids", True)), self.proc_root), None

    def _report(
        self,
        tags: list[ReleaseTag],
        epoch: int,
        need: dict[int, int],
        free: dict[int, int],
        holders: list[GpuProcess],
        processes: list[GpuProcess],
        message: str | None,
        waiting: bool,
        waited: float,
    ) -> None:
        report = ResumeHeadroom(
            epoch=epoch,
            tags=list(tags),
            waiting=waiting,
            message=message[:1024] if message else None,
            waited_seconds=round(waited, 3),
            gpus=[
                GpuHeadroom(gpu=i, need_bytes=n, free_bytes=free.get(i, 0))
                for i, n in sorted(need.items())[:MAX_GPUS_REPORTED]
            ],
            holders=holders[:MAX_GPUS_REPORTED],
            trainer_held=trainer_held(processes),
        )
        with self.store.change() as s:
            s.headroom = report


def shortfall(
    tags: list[ReleaseTag],
    short: list[int],
    need: dict[int, int],
    free: dict[int, int],
    holders: list[GpuProcess],
    unlisted: str | None,
) -> str:
    """`GPU 0: pid 4121 (trainer) holds 17.2 GiB; the resume of kv_cache needs 36.0 GiB (+0.5 GiB
    margin), 21.4 GiB free`, for each GPU short of memory."""
    parts = []
    for i in short:
        on_gpu = [p for p in holders if p.gpu == i]
        shown = [describe(p) for p in on_gpu[:MAX_HOLDERS_SHOWN]]
        if len(on_gpu) > MAX_HOLDERS_SHOWN:
            shown.append(f"{len(on_gpu) - MAX_HOLDERS_SHOWN} more processes")
        who = ", ".join(shown) or unlisted or "NVML lists no process"
        parts.append(
            f"GPU {i}: {who}; the resume of {_names(tags)} needs {gib(need[i])} "
            f"(+{gib(RESUME_MARGIN_BYTES)} margin), {gib(free.get(i, 0))} free"
        )
    return "; ".join(parts)[:1024]


def trainer_held(processes: list[GpuProcess]) -> str | None:
    """The trainer container's processes holding more than TRAINER_NOTICE_BYTES on a GPU, or None."""
    name = trainer_container()
    kept = [
        p
        for p in processes
        if p.container == name and p.used_bytes is not None and p.used_bytes > TRAINER_NOTICE_BYTES
    ]
    if not kept:
        return None
    held = "; ".join(f"{describe(p)} on GPU {p.gpu}" for p in kept)
    return f"{held} after returning its lease"[:1024]


def _names(tags: list[ReleaseTag]) -> str:
    return ", ".join(t.value for t in tags)
