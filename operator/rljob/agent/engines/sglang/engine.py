"""SGLang behind the handoff's verbs (agent/engines/base.py Engine): what each verb sends to SGLang, in what
order, with each version's quirks. Every call's rules: docs/sglang-conformance.md."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from rljob.agent.deadline import Deadline
from rljob.agent.engines.base import (
    Counter,
    Discovery,
    EngineError,
    EngineUnsupported,
    LoadSample,
    Served,
)
from rljob.agent.engines.http_engine import HTTPEngine
from rljob.agent.engines.sglang import metrics
from rljob.agent.engines.sglang.client import SGLangClient
from rljob.agent.engines.sglang.endpoint import SGLangEndpoint, build_app
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.engines.sglang.guards import SGLangGuards
from rljob.agent.engines.sglang.hang import SchedulerProbe
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.engines.sglang.weights import look
from rljob.agent.errors import CommandFailed
from rljob.agent.weights_look import Look
from rljob.api.agent import DistributedPush, InitWeightsGroup, TensorPush
from rljob.api.spec import DrainMode, EngineKind, RefitSource, ReleaseTag

if TYPE_CHECKING:  # the core modules the endpoint is handed, not imported (they import the registry)
    from rljob.agent.lease import LeaseDesk
    from rljob.agent.refit_window import RefitWindows
    from rljob.agent.state import StateStore

log = logging.getLogger("rljob.agent")

RESUME_ORDER = (ReleaseTag.CUDA_GRAPH, ReleaseTag.WEIGHTS, ReleaseTag.KV_CACHE)
FLUSH_SERVER_WAIT_CAP_S = 30.0
ABORT_SETTLE_S = 0.5  # half the 1 s an abort pause sleeps when it finds a request in flight
FIRST_POLL_S = 0.002
# The non-idempotent calls of the agent's record (agent/record.py Intent.call), as SGLang names them.
CALL_NAMES = {
    "release": "release_memory_occupation",
    "resume": "resume_memory_occupation",
    "refit": "update_weights_from_disk",
    "refit_window": "a tensor/distributed refit window",
}


class SGLangEngine(HTTPEngine[SGLangClient, SGLangFacts]):
    """One SGLang server (its HTTP API on the pod's loopback), driven through its client. SGLang has no
    route that tells which memory tags are released or whether a call is still running (its `/server_info`
    internal state has neither, docs/sglang-conformance.md §1; `/ready` reports paused or not from 0.5.20
    only, C-HEALTH-READY): a restarted agent's recovery reads `/model_info` (C-ROUTE-WV-READ) and the GPUs.

    Multi-node (C-NODE, C-TP-REPLY): only node rank 0 runs SGLang's HTTP server; the other nodes run
    schedulers and a dummy server that answers /ping, /health and /health_generate only, and get release,
    resume and refit from node 0 over the TP-group broadcast. A follower's agent calls `liveness` only."""

    kind = EngineKind.SGLANG
    name = "SGLang"
    resume_order = RESUME_ORDER
    call_names = CALL_NAMES
    metrics_off = metrics.METRICS_OFF
    guards = SGLangGuards()
    # A failed disk load rolls back to the weights it had (model_runner.py:1886-1891@0.5.15.post1).
    failed_load_poisons = False

    def __init__(self, client: SGLangClient, hang_probe_timeout_s: float = 5.0) -> None:
        super().__init__(client)
        self._hang = SchedulerProbe(client, hang_probe_timeout_s)

    @classmethod
    def build(
        cls,
        url: str,
        *,
        api_key: str | None,
        admin_api_key: str | None,
        call_timeout_s: float,
        observe: Callable[[str, float], None],
        hang_probe_timeout_s: float = 5.0,
    ) -> SGLangEngine:
        """`api_key`: SGLang's --api-key (normal routes, and lifecycle ones without an admin key);
        `admin_api_key`: its --admin-api-key, the only key its lifecycle routes take then (C-ROUTE-AUTH)."""
        client = SGLangClient(
            url, api_key=api_key, admin_api_key=admin_api_key, call_timeout_s=call_timeout_s, observe=observe
        )
        return cls(client, hang_probe_timeout_s)

    # --- presence --------------------------------------------------------------------------------------

    async def discover(self, timeout: float) -> Discovery:
        info = await self.client.server_info(timeout=timeout)
        quirks = SGLangQuirks.detect(str(info["version"]))
        facts = SGLangFacts.from_server_info(info)
        self.client.quirks = quirks
        model = await self.client.model_info(timeout=timeout)
        served = await self.client.served_version(timeout=timeout)
        if not quirks.is_supported:
            raise EngineUnsupported(
                f"SGLang {quirks.version} is older than the oldest supported version 0.5.6"
            )
        self._facts = facts
        archs = model.get("architectures")
        return Discovery(
            facts=facts,
            served=Served(served, str(model.get("model_path"))),
            architectures=tuple(str(a) for a in archs) if isinstance(archs, list) else (),
        )

    async def liveness(self, timeout: float = 5.0) -> int:
        """`/ping`: any HTTP answer means the process is alive (200 while paused, C-HEALTH-PING). Never
        `/health`: it blocks while paused, then fails."""
        return await self.client.ping(timeout=timeout)

    @property
    def needs_hang_check(self) -> bool:
        """C-DEATH-HARD: without a subprocess watchdog (0.5.6) SGLang's HTTP server outlives its scheduler."""
        quirks = self.client.quirks
        return quirks is not None and not quirks.subprocess_watchdog

    async def hang_check(self) -> str | None:
        return await self._hang.check()

    # --- stop new work ---------------------------------------------------------------------------------

    async def stop_new_work(self, mode: DrainMode, dl: Deadline) -> None:
        if mode == DrainMode.ABORT:
            await self._abort_in_flight(dl)
        try:
            await self.client.pause(mode.value, timeout=dl.remaining())
        except TimeoutError as e:
            raise CommandFailed(
                f"pause_generation({mode.value}) did not return within {dl.seconds:g}s "
                "(in-flight requests did not finish aborting)"
            ) from e
        except EngineError as e:
            raise CommandFailed(str(e)) from e

    async def _abort_in_flight(self, dl: Deadline) -> None:
        """C-DRAIN-ABORT-FIRST: an abort pause that finds a request still in flight sleeps 1 s before it
        looks again. Aborting first and giving the scheduler up to ABORT_SETTLE_S to go idle lets the pause
        find none. Best effort: traffic that keeps coming (the engine is not paused yet), a slow or refused
        call, all leave the stopping to the pause, which the drain makes in any case."""
        settle = Deadline(min(ABORT_SETTLE_S, dl.remaining()))
        backoff = FIRST_POLL_S
        try:
            await self.client.abort_all(timeout=max(0.001, settle.remaining()))
            while not await self.client.flush_cache(0.0, timeout=max(0.001, settle.remaining())):
                if settle.remaining() <= 0:
                    return
                await asyncio.sleep(min(backoff, settle.remaining()))
                backoff = min(backoff * 2, 0.05)
        except (TimeoutError, EngineError) as e:
            log.info("drain: abort before the pause did not settle (%s); the pause stops what runs", e)

    async def prove_idle(self, dl: Deadline, what: str, paused_by: DrainMode | None) -> None:
        """flush_cache succeeds only when the scheduler is idle by the predicate release asserts (the plain
        flush's, C-IDLE-RELEASE). The deferred `?timeout=` form saves round trips after an abort drain,
        but its check always counts waiting requests (C-IDLE-FLUSH-DEFERRED): after a retract it can only
        time out, so the plain flush is polled instead. With dp_size > 1 one flush 200 is the first rank's
        answer only (C-DP-FLUSH-FIRST) while release asserts on every rank (C-DP-RELEASE-ALL): every rank
        must report idle on the load route first."""
        quirks = self.client.quirks
        multi_rank = self._facts is not None and self._facts.dp_size > 1
        server_waits = (
            quirks is not None
            and quirks.flush_takes_timeout
            and paused_by != DrainMode.RETRACT
            and not multi_rank
        )
        backoff = 0.02
        busy = ""
        while True:
            remaining = dl.remaining()
            if remaining <= 0:
                detail = f" ({busy})" if busy else ""
                raise CommandFailed(f"{what}: SGLang did not become idle within {dl.seconds:g}s{detail}")
            try:
                busy = await self._busy_ranks(remaining, paused_by) if multi_rank else ""
                if not busy:
                    server_wait = min(FLUSH_SERVER_WAIT_CAP_S, remaining - 0.25) if server_waits else 0.0
                    if await self.client.flush_cache(max(0.0, server_wait), timeout=remaining):
                        return
            except TimeoutError as e:
                raise CommandFailed(f"{what}: SGLang did not answer within {dl.seconds:g}s") from e
            except EngineError as e:
                raise CommandFailed(str(e)) from e
            await asyncio.sleep(min(backoff, dl.remaining()))
            backoff = min(backoff * 2, 0.5)

    async def _busy_ranks(self, timeout: float, paused_by: DrainMode | None) -> str:
        """'' when every DP rank is idle by the release predicate, else which ranks are not. Waiting
        requests count, except the retracted ones on versions whose release ignores them
        (C-IDLE-RELEASE)."""
        facts, quirks = self._facts, self.client.quirks
        assert facts is not None and quirks is not None
        ranks = await self.client.rank_loads(timeout=timeout)
        retracted = paused_by == DrainMode.RETRACT
        ignore_waiting = retracted and quirks.release_ignores_waiting_when_retracted
        busy = [
            f"DP rank {rank}: {running} running, {waiting} waiting"
            for rank, running, waiting in ranks
            if running > 0 or (waiting > 0 and not ignore_waiting)
        ]
        if len({rank for rank, _, _ in ranks}) < facts.dp_size:
            busy.append(f"{self.client.load_route} reports {len(ranks)} of {facts.dp_size} DP ranks")
        return "; ".join(busy)

    # --- release and resume by part --------------------------------------------------------------------

    async def release(self, parts: Sequence[ReleaseTag], timeout: float) -> None:
        """One `/release_memory_occupation` of every tag (a set: C-MEM-DUP-TAG-RELEASE)."""
        await self.client.release([t.value for t in parts], timeout=timeout)

    async def resume(self, parts: Sequence[ReleaseTag], timeout: float) -> None:
        """One `/resume_memory_occupation`; a tag never released, or twice in one list, is a fatal KeyError
        in the scheduler (C-MEM-RESUME-UNRELEASED): the core sends each released tag once. A tag whose
        memory another process holds kills it (torch_memory_saver cannot map the region again and exits the
        scheduler, C-MEM-RESUME-OOM): the core's headroom gate sends it only once the memory is free, sized
        by /server_info's memory_usage (C-MEM-USAGE-REPORT, SGLangFacts.tag_bytes)."""
        await self.client.resume([t.value for t in parts], timeout=timeout)

    # --- load weights ----------------------------------------------------------------------------------

    async def load_from_disk(self, path: str, version: str, timeout: float) -> bool:
        """C-ROUTE-DISK; the version goes with the load (0.5.6 drops it while paused: `label_weights`). A
        paused load takes no lock, and a second one replaces the tokenizer's one result future the first
        still waits on (tokenizer_manager.py:2302-2314,2372-2381@0.5.23): the agent's recovery never sends
        one again while it may still run."""
        await self.client.update_weights_from_disk(path, version, timeout=timeout)
        return True

    async def label_weights(self, version: str, timeout: float, *, carried: bool) -> None:
        """C-REFIT-WV-PAUSED: the agent always refits paused, and 0.5.6 then drops weight_version; set it
        without a lock or an abort (C-ROUTE-WV-SET)."""
        quirks = self.client.quirks
        if carried and (quirks is None or quirks.refit_while_paused_records_version):
            return
        await self.client.update_weight_version(version, timeout=timeout)

    async def open_weight_update(self, dl: Deadline) -> None:
        """C-ROUTE-SESSION: from 0.5.21 a window's pushes sit between /begin_weight_update and
        /end_weight_update."""
        quirks = self.client.quirks
        if quirks is None or not quirks.weight_update_session:
            return
        try:
            await self.client.begin_weight_update(timeout=dl.remaining())
        except EngineError as e:
            if "already open" not in e.message:
                raise
            # A window that failed before its end call left the session open: close it, start clean.
            log.warning("weight-update session was still open; ending it first")
            await self.client.end_weight_update(timeout=dl.remaining())
            await self.client.begin_weight_update(timeout=dl.remaining())

    async def close_weight_update(self, timeout: float) -> None:
        quirks = self.client.quirks
        if quirks is None or not quirks.weight_update_session:
            return
        try:
            await self.client.end_weight_update(timeout=timeout)
        except (EngineError, TimeoutError) as e:
            raise CommandFailed(f"end_weight_update failed: {e}") from e

    async def push_tensors(self, push: TensorPush, version: str | None, timeout: float) -> str:
        """C-ROUTE-TENSOR with flush_cache=false (the refit flushes once, after the window)."""
        return await self.client.update_weights_from_tensor(
            push.serialized_named_tensors, push.load_format, version, timeout=timeout
        )

    async def join_weights_group(self, group: InitWeightsGroup, timeout: float) -> str:
        """C-REFIT-GROUP-BLOCK: answers only once every rank joined the trainer's rendezvous."""
        return await self.client.init_weights_update_group(group.model_dump(), timeout=timeout)

    async def push_distributed(self, push: DistributedPush, version: str | None, timeout: float) -> str:
        return await self.client.update_weights_from_distributed(
            push.names, push.dtypes, push.shapes, push.group_name, version, timeout=timeout
        )

    # --- flush and continue ----------------------------------------------------------------------------

    async def flush_prefix_cache(self, dl: Deadline, paused_by: DrainMode | None) -> None:
        """The pushes ran with flush_cache=false: one flush, once SGLang is idle (the idle proof's flush)."""
        await self.prove_idle(dl, "refit", paused_by)

    async def continue_serving(self, dl: Deadline, on_continued: Callable[[], None]) -> Served:
        """C-RESUME-PROBE: the resumed engine must generate a token before rollout opens. The probe goes out
        first and waits in the paused tokenizer (C-PAUSE-GENERATE-WAITS), so it runs as soon as
        continue_generation lets it, and the served version is read meanwhile."""
        probe = asyncio.create_task(self.client.generate_probe(timeout=max(1.0, dl.remaining())))
        try:
            await self.client.continue_generation(timeout=dl.remaining())
        except BaseException as e:
            probe.cancel()
            if isinstance(e, TimeoutError):
                raise CommandFailed("continue_generation did not answer before the deadline") from e
            if isinstance(e, EngineError):
                raise CommandFailed(str(e)) from e
            raise
        on_continued()
        return await self._served_after_probe(probe, dl)

    async def _served_after_probe(self, probe: asyncio.Task[None], dl: Deadline) -> Served:
        """The probe's token and the served weight_version, read concurrently."""
        reading = asyncio.create_task(self.client.served_version(timeout=max(1.0, dl.remaining())))
        try:
            await probe
        except TimeoutError as e:
            reading.cancel()
            raise CommandFailed(f"SGLang generated no token within {dl.seconds:g}s of the resume") from e
        except EngineError as e:
            reading.cancel()
            raise CommandFailed(f"SGLang cannot generate after the resume: {e}") from e
        try:
            return Served(await reading, None)
        except (EngineError, TimeoutError) as e:
            raise CommandFailed(f"cannot read the served weight_version: {e}") from e

    # --- read what it serves ---------------------------------------------------------------------------

    async def served(self, timeout: float) -> Served:
        """C-ROUTE-WV-READ: `/model_info`'s weight_version (every version has it) and model_path."""
        return Served(*await self.client.served(timeout=timeout))

    async def read_load(self, timeout: float = 5.0) -> LoadSample:
        """C-METRIC-LOAD-ROUTE over the DP ranks. Its `utilization` is not read: SGLang never sets it (0.0,
        or -1 in PD prefill; C-METRIC-UTILIZATION)."""
        load = await self.client.load(timeout=timeout)
        return LoadSample(
            running=load["running"],
            waiting=load["waiting"],
            cache_hit_rate=load["cache_hit_rate"],
            gen_throughput=load["gen_throughput"],
        )

    async def read_counters(self, timeout: float = 5.0) -> dict[Counter, float] | None:
        """None without --enable-metrics (`/metrics` is a 404: C-METRIC-PROM, C-METRIC-OFF)."""
        series = await self.client.metrics(timeout=timeout)
        return None if series is None else metrics.counters(series)

    async def read_weights(self, weights_released: bool, timeout: float) -> Look:
        return await look(self.client, weights_released, timeout)

    # --- plumbing --------------------------------------------------------------------------------------

    def framework_endpoint(
        self, store: StateStore, lease: LeaseDesk, windows: RefitWindows, refit_source: RefitSource | None
    ) -> web.Application:
        """The SGLang-compatible endpoint a framework is pointed at instead of SGLang (endpoint.py)."""
        return build_app(SGLangEndpoint(store, lease, windows, self.client, refit_source))
