"""What each accepted command does to the engine, in the safe order of docs/lifecycle.md, through the
handoff's verbs (agent/engines/base.py; each engine's calls and their rules are in its folder): drain,
release with per-GPU verification, grant, refit (disk, or a tensor/distributed window), resume. Every
engine call is bounded by the command's deadline. A non-idempotent call that does not answer leaves the
engine's state unknown: that raises StateLost (the pod must be replaced) rather than guessing.

Each non-idempotent call (release, resume, a disk refit's load, a refit window) is announced in the
pod-local record before it is made and closed with its outcome (StateStore.announce/outcome), and each
command skips what the record says is done: a restarted agent re-runs the command it was running
without repeating a call (agent/recovery.py).

Each action returns what it records with its stage move (a `Record`); agent/actions.py commits both in
one revision."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from rljob.agent.deadline import Deadline
from rljob.agent.engines.base import Engine, EngineError, EngineUnreachable
from rljob.agent.errors import CommandFailed, PermanentFailure, StateLost
from rljob.agent.gpu_probe import GpuMemory, GpuProbe
from rljob.agent.gpu_scope import report_gpu_scope
from rljob.agent.headroom import HeadroomGate
from rljob.agent.lease import LeaseDesk
from rljob.agent.metrics import AgentMetrics
from rljob.agent.record import Intent
from rljob.agent.refit_window import RefitWindows
from rljob.agent.state import StateStore
from rljob.agent.transitions import refit_path
from rljob.agent.weights_check import WEIGHTS_MISMATCH, Expected, Held, judge, unverified
from rljob.agent.weights_look import Look, timed
from rljob.api.agent import (
    AgentState,
    DrainCommand,
    GrantCommand,
    MemoryReport,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    RolloutReport,
    Stage,
    WeightsCheck,
)
from rljob.api.spec import DrainMode, RefitSource, ReleaseTag, ReleaseVerify

log = logging.getLogger("rljob.agent")

VERIFY_FIRST_POLL_S, VERIFY_MAX_POLL_S = 0.002, 0.1
RELEASE_SHORTFALL = "ReleaseShortfall"
FREED_STABLE_S = 1.0  # freed memory unchanged this long when verification times out: nothing is coming
FREED_NOISE_BYTES = 64 << 20  # NVML's used memory moves a little on its own (allocator, context)

Record: TypeAlias = Callable[[AgentState], None] | None  # written in the action's stage-move revision


class FreedHistory:
    """What release verification saw: the bytes freed per GPU, and when they last moved. It tells a
    deterministic shortfall (the released tags hold less than `verify` asks, e.g. only cuda_graph with
    minFreedFraction 0.5) from a delayed unmap that has not finished (slime#579)."""

    def __init__(self) -> None:
        self.freed: dict[int, int] = {}
        self.changed_at: float | None = None

    def add(self, freed: dict[int, int], now: float) -> None:
        moved = freed.keys() != self.freed.keys() or any(
            abs(freed[i] - self.freed[i]) > FREED_NOISE_BYTES for i in freed
        )
        if moved:
            self.changed_at = now
        self.freed = dict(freed)

    def shortfall_is_final(self, need: dict[int, int], now: float, window_s: float) -> bool:
        """True when every GPU still short has freed something (its unmap ran: the tags took effect)
        and nothing moved for the last min(FREED_STABLE_S, half the window). A GPU that freed nothing
        may not have unmapped yet, and memory still moving may reach the target: both stay retryable."""
        short = [i for i in need if self.freed.get(i, 0) < need[i]]
        if not short or self.changed_at is None:
            return False
        if any(self.freed.get(i, 0) <= FREED_NOISE_BYTES for i in short):
            return False
        return now - self.changed_at >= min(FREED_STABLE_S, window_s / 2)


class Operations:
    def __init__(
        self,
        store: StateStore,
        engine: Engine,
        probe: GpuProbe,
        windows: RefitWindows,
        lease: LeaseDesk,
        metrics: AgentMetrics,
        call_timeout_s: float,
        before_drain: Callable[[], Awaitable[None]] | None = None,
        before_serving: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.before_drain = before_drain
        self.before_serving = before_serving
        self.store = store
        self.engine = engine
        self.probe = probe
        self.windows = windows
        self.lease = lease
        self.metrics = metrics
        self.call_timeout_s = call_timeout_s
        self._probe_warmed: asyncio.Task[None] | None = None
        self.headroom = HeadroomGate(store, probe, self._sample)  # before every resume

    @property
    def pause_mode(self) -> DrainMode | None:
        """How the engine was paused (kept in the store, so in the record: its idle proof reads it)."""
        return self.store.pause_mode

    @pause_mode.setter
    def pause_mode(self, mode: DrainMode | None) -> None:
        self.store.pause_mode = mode

    # --- drain -----------------------------------------------------------------------------------

    async def drain(self, cmd: DrainCommand) -> Record:
        dl = Deadline(cmd.timeout_seconds)
        if self.before_drain is not None:
            await self.before_drain()  # last rollout sample, while requests still run
        await self._stop(cmd.mode, dl)
        await self.engine.prove_idle(dl, "drain", self.pause_mode)
        return None

    async def _stop(self, mode: DrainMode, dl: Deadline) -> None:
        with self.store.change() as s:
            s.engine.paused = True  # from here on the engine may be paused: never assume otherwise
        if self.pause_mode != DrainMode.RETRACT:  # a retract stays in effect until the engine continues
            self.pause_mode = mode
        await self.engine.stop_new_work(mode, dl)

    # --- release ---------------------------------------------------------------------------------

    async def release(self, cmd: ReleaseCommand) -> Record:
        unique = list(dict.fromkeys(cmd.tags))  # each tag once
        tags = [t.value for t in unique]
        if self.store.release_before and all(t in self.store.state.released_tags for t in unique):
            # Re-run after the agent's restart, the release already made (recorded, or proven by freed
            # memory): a second one may kill the engine. Verify it against the sample taken before it.
            before = [GpuMemory(i, used, 0) for i, used in sorted(self.store.release_before.items())]
            await self._verify_freed(before, cmd.verify, tags)
            return None
        # Re-check idleness right before the call: a release of a busy engine may kill it. The memory
        # before is sampled meanwhile: the idle proof frees no GPU memory (the KV pool is static), and the
        # probe's first call (NVML init) then costs the release nothing.
        t0 = time.perf_counter()
        sampling = asyncio.create_task(self._sample())
        try:
            await self.engine.prove_idle(Deadline(cmd.verify.timeout_seconds), "release", self.pause_mode)
        except BaseException:
            sampling.cancel()
            raise
        t1 = time.perf_counter()
        before = await sampling
        t2 = time.perf_counter()
        await self._release_call(cmd, unique, before)
        t3 = time.perf_counter()
        samples = await self._verify_freed(before, cmd.verify, tags)
        spent = {"barrier": t1 - t0, "before_sample_wait": t2 - t1, "release_call": t3 - t2}
        spent["verify"] = time.perf_counter() - t3
        timing = {f"{k}_s": round(v, 6) for k, v in spent.items()}
        log.info("release timing %s", json.dumps({**timing, "verify_samples": samples}))
        return None

    async def _release_call(
        self, cmd: ReleaseCommand, unique: list[ReleaseTag], before: list[GpuMemory]
    ) -> None:
        """The release itself, announced with the memory before it (a restarted agent's evidence)."""
        tags = [t.value for t in unique]
        self.store.release_before = {g.index: g.used_bytes for g in before}
        self.store.release_freed, self.store.taken_back = {}, {}  # a new cycle for the headroom gate
        with self.store.change() as s:
            s.memory = MemoryReport(used_before_bytes=sum(g.used_bytes for g in before), gpus=len(before))
        named = self.engine.call_name("release")
        self.store.announce(
            Intent("release", cmd.epoch, tuple(tags), used_before=self.store.release_before, named=named)
        )
        try:
            await self.engine.release(unique, timeout=self.call_timeout_s)
        except TimeoutError as e:
            raise StateLost(
                f"{named}({', '.join(tags)}) did not answer in {self.call_timeout_s:g}s: "
                "whether the tags are released is unknown"
            ) from e
        except EngineError as e:
            with self.store.outcome():
                pass
            raise CommandFailed(str(e)) from e  # refused before it ran: nothing was released
        with self.store.outcome() as s:
            s.released_tags = [*s.released_tags, *unique]

    def warm_probe(self) -> None:
        """The probe's first call initialises its library (NVML): do it in the background at the first
        command, not inside the first release. Errors show at a release's sample."""
        if self._probe_warmed is None:
            self._probe_warmed = asyncio.create_task(self._quiet_sample(), name="warm-gpu-probe")

    async def _quiet_sample(self) -> None:
        with contextlib.suppress(Exception):
            await self.probe.sample()
        report_gpu_scope(self.store, self.probe)  # which GPUs are the pod's, before any release

    async def _quiet_memory(self) -> list[GpuMemory]:
        """Used memory after a resume, what it took back for the headroom gate; [] on errors."""
        try:
            return await self.probe.sample()
        except Exception:  # evidence only: the resume does not depend on it
            return []

    async def _sample(self) -> list[GpuMemory]:
        try:
            gpus = await self.probe.sample()
        except EngineUnreachable:
            raise  # a probe that reads through the engine's port: its loss is the engine's death
        except Exception as e:  # NVML errors have no common base class worth naming
            raise CommandFailed(f"GPU probe failed: {e.__class__.__name__}: {e}") from e
        report_gpu_scope(self.store, self.probe, len(gpus))
        if not gpus:
            raise CommandFailed("GPU probe sees no GPU")
        return gpus

    async def _verify_freed(self, before: list[GpuMemory], verify: ReleaseVerify, tags: list[str]) -> int:
        """Every GPU must free max(min_freed_bytes, fraction x used_before): release returns when rank 0
        is done, other ranks (and delayed unmaps) may still hold memory (slime#579, miles#86). A shortfall
        that stopped moving is permanent (PermanentFailure, ReleaseShortfall): a restart frees no more."""
        dl = Deadline(verify.timeout_seconds)
        loop = asyncio.get_running_loop()
        used_before = {g.index: g.used_bytes for g in before}
        need = freed_target(verify, used_before)
        history = FreedHistory()
        # NVML shows an unmap within a millisecond: poll tightly at first (a release that returned with
        # its memory freed costs one sample), then back off for slow ranks and delayed unmaps.
        pause, samples = VERIFY_FIRST_POLL_S, 0
        while True:
            after = await self._sample()
            samples += 1
            freed = {g.index: used_before.get(g.index, 0) - g.used_bytes for g in after}
            if set(freed) != set(need):
                raise CommandFailed(f"GPU set changed during release: {sorted(need)} -> {sorted(freed)}")
            history.add(freed, loop.time())
            ok = all(freed[i] >= need[i] for i in need)
            if ok or dl.remaining() <= 0:
                break
            await asyncio.sleep(min(pause, dl.remaining()))
            pause = min(pause * 2, VERIFY_MAX_POLL_S)
        self._report_freed(after, freed, ok)
        if not ok:
            raise _shortfall(
                freed,
                need,
                history.shortfall_is_final(need, loop.time(), verify.timeout_seconds),
                verify,
                tags,
            )
        return samples

    def _report_freed(self, after: list[GpuMemory], freed: dict[int, int], ok: bool) -> None:
        for i, f in freed.items():
            self.metrics.freed_bytes.labels(str(i)).set(max(0, f))
        self.store.release_freed = {i: max(0, f) for i, f in freed.items()}  # what the resumes take back
        with self.store.change() as s:
            s.memory.used_after_bytes = sum(g.used_bytes for g in after)
            s.memory.freed_bytes = max(0, min(freed.values()))
            s.memory.verified = ok

    # --- resume helpers --------------------------------------------------------------------------

    async def _resume_tags(self, tags: list[ReleaseTag], dl: Deadline) -> None:
        """A resume of a part never released, or twice in one call, may kill the engine: each part goes
        once, and only if released."""
        tags = list(dict.fromkeys(tags))
        if not tags:
            return
        unreleased = [t.value for t in tags if t not in self.store.state.released_tags]
        if unreleased:
            raise CommandFailed(
                f"not resuming {', '.join(unreleased)}: not released (a resume would kill {self.engine.name})"
            )
        await self._resume_call(tags, dl)

    async def _resume_call(self, tags: list[ReleaseTag], dl: Deadline) -> None:
        """The resume itself, once the headroom gate found its memory free on every GPU (agent/headroom.py),
        announced with the memory before it (a restarted agent's evidence)."""
        names = [t.value for t in tags]
        epoch = self.store.state.epoch
        before = await self.headroom.clear(tags, epoch, dl.remaining)
        used = {g.index: g.used_bytes for g in before}
        named = self.engine.call_name("resume")
        self.store.announce(Intent("resume", epoch, tuple(names), used_before=used, named=named))
        try:
            await self.engine.resume(tags, timeout=dl.remaining())
        except TimeoutError as e:
            raise StateLost(
                f"{named}({', '.join(names)}) did not answer within the deadline "
                "(out of GPU memory?): whether the tags are resumed is unknown"
            ) from e
        except EngineError as e:
            with self.store.outcome():
                pass
            raise CommandFailed(str(e)) from e
        after = await self._quiet_memory()
        with self.store.outcome() as s:
            s.released_tags = [t for t in s.released_tags if t not in tags]
            self.headroom.took_back(before, after)

    def _released(self, *candidates: ReleaseTag) -> list[ReleaseTag]:
        return [t for t in candidates if t in self.store.state.released_tags]

    # --- refit -----------------------------------------------------------------------------------

    async def refit(self, cmd: RefitCommand) -> Record:
        dl = Deadline(cmd.timeout_seconds)
        path = refit_path(cmd, self.store.state)
        # New weights come from a trainer's publish; a rejoin or a reload brings back the committed ones.
        new_weights = self.store.state.stage == Stage.TRAINED and not cmd.reload
        unpaused = self.store.state.stage in (Stage.READY, Stage.SERVING)
        if unpaused:  # rejoin after recovery: drain first
            await self._stop(DrainMode.ABORT, dl)
        # A load that finds work may kill the engine: refit only while paused and idle. A release proved
        # idleness and the engine stayed paused since (nothing can have started).
        if unpaused or not self.store.state.released_tags:
            await self.engine.prove_idle(dl, "refit", self.pause_mode)
        if unpaused:
            with self.store.change(stage=Stage.DRAINED):
                pass
        facts = self.store.facts
        discarded = bool(self._released(ReleaseTag.WEIGHTS)) and not (facts and facts.weights_survive_release)
        if cmd.reload and discarded:  # saved with the resume's announcement: a restart still owes the load
            self.store.reload_owed = cmd.version
        # Multi-stage resume: every part but the last now (weights among them), the last only at resume;
        # the engine stays paused.
        resumed = self._released(*self.engine.resume_order[:-1])
        await self._resume_tags(resumed, dl)
        if discarded and ReleaseTag.WEIGHTS in resumed:
            with self.store.change() as s:  # until a load completes, a resume is refused (transitions.py)
                s.engine.unloaded = (
                    f"the weights came back from a release that discarded them ({self.engine.name} kept no "
                    "copy): their contents are undefined until a load completes"
                )
        # What the resumed (discarded) weights hold before the load: new weights that hash the same moved
        # nothing. Weights the release kept are the previous version's: their checksum is known. A disk
        # load with a usable digest needs no look: garbage left in place fails the digest.
        before = None
        if (
            new_weights
            and discarded
            and self.store.refit_done != cmd.version
            and not self._digest_decides(cmd)
        ):
            before = await self.engine.read_weights(weights_released=False, timeout=max(1.0, dl.remaining()))
        reloaded: str | None = None
        try:
            if cmd.reload:
                reloaded = await self._reload(cmd, discarded, dl)
                carried = True
            else:
                carried = await self._load(cmd, path, dl)
            # The label where the load did not carry it (or the engine dropped it), verified below.
            await self.engine.label_weights(cmd.version, timeout=max(1.0, dl.remaining()), carried=carried)
            served = await self._served_label(cmd.version, dl)
        except EngineError as e:
            raise CommandFailed(str(e)) from e
        except TimeoutError as e:
            raise CommandFailed(f"refit did not finish within {dl.seconds:g}s") from e
        if served != cmd.version:
            raise CommandFailed(
                f"{self.engine.name} serves weight_version {served!r} after the refit, "
                f"expected {cmd.version!r}"
            )
        weights = await self._check_weights(cmd, new_weights, before, dl)

        loaded = reloaded if cmd.reload else (path if cmd.source == RefitSource.DISK else None)

        def record(s: AgentState) -> None:
            s.engine.served_version = served
            s.engine.weights = weights
            if loaded is not None:
                s.engine.model_path = loaded
            if loaded is not None or not cmd.reload:  # a pushed version is in no checkpoint the engine read
                self.store.path_version = served if loaded is not None else None

        return record

    async def _served_label(self, version: str, dl: Deadline) -> str | None:
        """The label the engine serves its weights under; an engine that carries none is labelled by the
        agent (EngineFacts.reports_version): its weights are held to their checksum, where it takes one."""
        facts = self.store.facts
        if facts is not None and not facts.reports_version:
            return version
        return (await self.engine.served(timeout=max(1.0, dl.remaining()))).version

    async def _check_weights(
        self, cmd: RefitCommand, new_weights: bool, before: Look | None, dl: Deadline
    ) -> WeightsCheck:
        """What the engine holds now, by content, held against what it must be (agent/weights_check.py): a
        mismatch fails the refit (WeightsMismatch) naming the parameters, so rollout never opens on them.
        Where no checksum can be taken, the report says "weights not verified: <reason>". `before`: the
        look at the discarded weights before the load."""
        started = time.perf_counter() - (before.seconds if before is not None else 0.0)
        released = ReleaseTag.WEIGHTS in self.store.state.released_tags
        seen = await self.engine.read_weights(released, timeout=max(1.0, dl.remaining()))
        if seen.held is None:
            return timed(unverified(str(seen.why), cmd.version), seen, started)
        want = self._expected(cmd, new_weights, before.held if before is not None else None)
        verdict = judge(seen.held, want)
        if not verdict.failures:  # what later checks compare with: verified weights only
            self.store.weights_held = seen.held
        report = timed(verdict.report(seen.held, cmd.version), seen, started)
        if before is not None:
            report.checker_seconds = round((report.checker_seconds or 0.0) + before.seconds, 6)
        log.info(
            "weights checked at %s: checksum %s, %d parameters, checker %.1f ms, check %.1f ms, %s",
            cmd.version,
            seen.held.checksum[:16],
            seen.held.parameters,
            (report.checker_seconds or 0) * 1e3,
            (report.seconds or 0) * 1e3,
            "; ".join(verdict.failures) or "ok",
        )
        if verdict.failures:
            with self.store.change() as s:  # what the engine holds, for the operator's message
                s.engine.weights = report
            raise CommandFailed(f"{WEIGHTS_MISMATCH}: {'; '.join(verdict.failures)}", reason=WEIGHTS_MISMATCH)
        return report

    def _digest_decides(self, cmd: RefitCommand) -> bool:
        """A disk refit whose published digest will be compared parameter by parameter (TP 1, not
        quantized): a load that moved nothing leaves what the digest is not."""
        given, facts = self.store.trainer_digest, self.store.facts
        return (
            cmd.source == RefitSource.DISK
            and given is not None
            and given[0] == cmd.version
            and given[1] is not None
            and not given[1].unavailable
            and facts is not None
            and facts.tp_size == 1
            and facts.quantization is None
        )

    def _expected(self, cmd: RefitCommand, new_weights: bool, before_load: Held | None) -> Expected:
        facts = self.store.facts
        given = self.store.trainer_digest
        digest, no_digest = None, f"the trainer gave no digest for {cmd.version}"
        if given is not None and given[0] == cmd.version:
            digest, no_digest = given[1], given[2]
        quantized = facts.quantization if facts is not None else None
        return Expected(
            version=cmd.version,
            new_weights=new_weights,
            reload=cmd.reload,
            digest=digest,
            no_digest=no_digest,
            previous=self.store.state.engine.weights,
            previous_held=self.store.weights_held,
            before_load=before_load,
            committed_checksum=cmd.committed_checksum,
            committed_layout=cmd.committed_layout,
            whole_tensors=(
                f"{self.engine.name} runs a quantized model (--quantization {quantized}): it hashes "
                "dequantized weights"
                if quantized
                else None
            ),
        )

    async def _reload(self, cmd: RefitCommand, discarded: bool, dl: Deadline) -> str | None:
        """A lease given back without new weights: the committed version again. Weights the release kept,
        or the engine's host copy restored (the resume before this), need nothing more; weights it discarded
        come from a disk load of the checkpoint the engine last loaded that version from (its own path),
        else of the command's path. The path loaded, if any. A restarted agent re-running the command finds
        the weights resumed and the load still owed in its record (StateStore.reload_owed), and makes it."""
        if not discarded and self.store.reload_owed != cmd.version:
            return None
        known = self.store.state.engine.model_path if self.store.path_version == cmd.version else None
        path = known or cmd.path
        if path is None:
            facts = self.store.facts
            keep = f"{facts.keep_weights_hint}, " if facts is not None else ""
            raise PermanentFailure(
                "WeightsNotReloadable",
                f"the release discarded weights {cmd.version} ({self.engine.name} keeps no copy of them) and "
                f"no checkpoint of them is known: push weights before resuming, {keep}or leave weights out "
                "of spec.release.tags",
            )
        await self._load_from_disk(cmd, path, dl)
        return path

    async def _load(self, cmd: RefitCommand, path: str | None, dl: Deadline) -> bool:
        """The new weights into the engine, once: a re-run after the agent's restart skips a recorded load.
        False when the engine was not given the version with them (a window closed without a final push)."""
        if self.store.refit_done == cmd.version:
            return True
        if cmd.source != RefitSource.DISK:
            return await self._refit_window(cmd, dl)
        assert path is not None  # transitions.refit_inputs refused a disk refit without one
        return await self._load_from_disk(cmd, path, dl)

    async def _load_from_disk(self, cmd: RefitCommand, path: str, dl: Deadline) -> bool:
        """The disk load of `path` as `cmd.version`, announced in the record and closed with its outcome;
        whether the load carried the version label (Engine.load_from_disk)."""
        named = self.engine.call_name("refit")
        self.store.announce(Intent("refit", cmd.epoch, version=cmd.version, path=path, named=named))
        try:
            carried = await self.engine.load_from_disk(path, cmd.version, timeout=dl.remaining())
        except EngineError as e:
            with self.store.outcome() as s:  # the engine answered: the load failed, and nothing is unknown
                self._load_failed(s, f"{named}({path}) failed: {e.message}")
            raise
        with self.store.outcome() as s:
            self.store.refit_done = cmd.version
            self.store.reload_owed = None
            s.engine.unloaded = None
        return carried

    def _load_failed(self, s: AgentState, why: str) -> None:
        """A load that failed: an engine it leaves unable to serve is not resumed until a load completes."""
        if self.engine.failed_load_poisons:
            s.engine.unloaded = f"{why}: {self.engine.name} cannot serve until a load completes"[:1024]

    async def _refit_window(self, cmd: RefitCommand, dl: Deadline) -> bool:
        await self.engine.open_weight_update(dl)
        # The trainer's pushes go to the engine while the window is open: a restarted agent cannot replay
        # them.
        named = self.engine.call_name("refit_window")
        self.store.announce(Intent("refit_window", cmd.epoch, version=cmd.version, named=named))
        failure, versioned = await self._window(cmd, dl)
        try:
            await self.engine.close_weight_update(timeout=max(1.0, dl.remaining()))
        except CommandFailed as e:
            failure = failure or e
        with self.store.outcome() as s:
            if failure is None:
                self.store.refit_done = cmd.version
                s.engine.unloaded = None
            else:
                self._load_failed(s, f"the {named} for {cmd.version} failed ({failure})")
        if failure is not None:
            raise failure
        await self.engine.flush_prefix_cache(dl, self.pause_mode)  # the pushes left it: flush once, now
        return versioned

    async def _window(self, cmd: RefitCommand, dl: Deadline) -> tuple[CommandFailed | None, bool]:
        """The trainer's window, open until it closes it: (None, whether the final push carried the
        version) when its pushes ended with a final one or the closer left the version to the agent."""
        window = self.windows.open(cmd.version, cmd.source, dl.remaining())
        try:
            await self.windows.wait_closed(window)
        except TimeoutError:
            return CommandFailed(f"the trainer did not close the refit window within {dl.seconds:g}s"), False
        finally:
            self.windows.shut(window)
        if window.error is not None:
            return CommandFailed(f"refit window failed: {window.error}"), False
        if not window.final_pushed and not window.versioned_by_agent:
            return CommandFailed("the trainer closed the refit window without a final push"), False
        return None, window.final_pushed

    # --- resume ----------------------------------------------------------------------------------

    async def grant(self, cmd: GrantCommand) -> Record:
        return self.lease.grant(cmd.epoch)

    async def resume(self, cmd: ResumeCommand) -> Record:
        dl = Deadline(cmd.timeout_seconds)
        unloaded = self.store.state.engine.unloaded
        if unloaded is not None:  # refused by transitions.resume_bookkeeping: kept for a re-run
            raise CommandFailed(f"not resuming: {unloaded}")
        await self._resume_tags(self._released(*self.engine.resume_order), dl)
        expected = self.store.state.engine.served_version
        served = (await self.engine.continue_serving(dl, self._serving)).version
        facts = self.store.facts
        if facts is not None and not facts.reports_version:
            served = expected  # the agent's label: the probe's token showed the engine serves
        if served != expected:
            raise CommandFailed(f"{self.engine.name} serves weight_version {served!r}, expected {expected!r}")
        if self.before_serving is not None:
            await self.before_serving()  # the rollout's baseline, before any rollout request can finish
        return _new_rollout

    def _serving(self) -> None:
        """The engine took the call to serve again: it is no longer paused."""
        self.pause_mode = None
        with self.store.change() as s:
            s.engine.paused = False


def freed_target(verify: ReleaseVerify, used_before: dict[int, int]) -> dict[int, int]:
    """Per GPU, the bytes a release must free: max(min_freed_bytes, min_freed_fraction x used before)."""
    return {
        i: max(verify.min_freed_bytes, int(verify.min_freed_fraction * u)) for i, u in used_before.items()
    }


def _new_rollout(s: AgentState) -> None:
    s.rollout = RolloutReport()


def _shortfall(
    freed: dict[int, int], need: dict[int, int], final: bool, verify: ReleaseVerify, tags: list[str]
) -> CommandFailed:
    """A release that did not free what `verify` asks: permanent (ReleaseShortfall) when nothing moves."""
    short = ", ".join(
        f"GPU {i} freed {max(0, freed[i])} of {need[i]} bytes" for i in need if freed[i] < need[i]
    )
    if final:
        return PermanentFailure(
            RELEASE_SHORTFALL,
            f"releasing {', '.join(tags)} cannot free what verify asks: {short}, unchanged at the "
            f"end of {verify.timeout_seconds}s (choose more release.tags or lower release.verify)",
        )
    return CommandFailed(f"release not verified within {verify.timeout_seconds}s: {short}")
