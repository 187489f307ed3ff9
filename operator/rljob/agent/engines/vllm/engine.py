"""vLLM behind the handoff's verbs (agent/engines/base.py Engine): what each verb sends to vLLM, in what
order, with each version's quirks. Every call's rules: docs/vllm-conformance.md (§8 maps the verbs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

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
from rljob.agent.engines.vllm import metrics
from rljob.agent.engines.vllm.client import VLLMClient
from rljob.agent.engines.vllm.endpoint import VLLMEndpoint, build_app
from rljob.agent.engines.vllm.facts import VLLMFacts
from rljob.agent.engines.vllm.guards import DISTRIBUTED, VLLMGuards
from rljob.agent.engines.vllm.quirks import SUPPORTED, VLLMQuirks
from rljob.agent.engines.vllm.weights import look
from rljob.agent.errors import CommandFailed, StateLost
from rljob.agent.weights_look import Look
from rljob.api.agent import DistributedPush, InitWeightsGroup, TensorPush
from rljob.api.spec import DrainMode, EngineKind, RefitSource, ReleaseTag

if TYPE_CHECKING:  # the core modules the endpoint is handed, not imported (they import the registry)
    from rljob.agent.lease import LeaseDesk
    from rljob.agent.refit_window import RefitWindows
    from rljob.agent.state import StateStore

log = logging.getLogger("rljob.agent")

RESUME_ORDER = (ReleaseTag.WEIGHTS, ReleaseTag.KV_CACHE)  # V-MEM-WAKE-ORDER: the last wake schedules again
# §8: the agent's drain modes as vLLM's pause modes (`keep` with clear_cache preempts: V-DRAIN-KEEP).
PAUSE_MODES = {DrainMode.ABORT: "abort", DrainMode.RETRACT: "keep", DrainMode.WAIT: "wait"}
# V-MEM-LEVELS: level 2 discards the weights (a refit follows), level 1 keeps them on the host.
DISCARD_LEVEL, HOST_COPY_LEVEL = 2, 1
LAUNCH_LABEL = (
    "default"  # what 0.34 labels the weights it launched with (core:161@0.34.0); the agent too on 0.26
)
EXPOSURE_PROBE_S = 0.5
CALL_NAMES = {
    "release": "sleep",
    "resume": "wake_up",
    "refit": "reload_weights",
    "refit_window": "weight-transfer session",
}


def outbound_addresses() -> list[str]:
    """This host's addresses beyond loopback that a peer would reach it on (the pod IP): the source
    address of a route out, found without sending a packet."""
    found = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.254.254.254", 1))
        found.append(str(s.getsockname()[0]))
    return [a for a in found if not a.startswith("127.") and a != "0.0.0.0"]


class VLLMEngine(HTTPEngine[VLLMClient, VLLMFacts]):
    """One vLLM API server (its HTTP API on the pod's loopback), driven through its client. vLLM's wake of
    the last sleeping part resumes scheduling by itself (V-MEM-WAKE-ORDER): the refit and its verification
    run between the `weights` and the `kv_cache` wake, and nothing is forwarded in between."""

    kind = EngineKind.VLLM
    name = "vLLM"
    resume_order = RESUME_ORDER
    call_names = CALL_NAMES
    metrics_off = metrics.METRICS_OFF
    guards = VLLMGuards()
    failed_load_poisons = True  # V-KILL-REFIT-FAILED: a failed update or reload leaves layers unbuilt
    needs_hang_check = True  # V-DEATH-EXC: /health answers 503 until the API server exits (or for good)

    def __init__(
        self, client: VLLMClient, *, refit_source: RefitSource | None = None, keep_weights: bool = False
    ) -> None:
        super().__init__(client)
        self._refit_source = refit_source
        self._keep_weights = keep_weights
        self._asleep: set[ReleaseTag] = set()  # what this agent process put to sleep and has not woken
        self._mode = PAUSE_MODES[DrainMode.ABORT]  # the pause mode a sleep repeats (§8)
        self._transfer_ready = False  # /init_weight_transfer_engine answered (once per vLLM process)
        self._final_version: str | None = None  # the window's version, labelled at its finish (0.34)
        self._last_load: tuple[float, dict[str, float]] | None = None  # read_load's previous series

    @classmethod
    def build(
        cls,
        url: str,
        *,
        api_key: str | None,
        call_timeout_s: float,
        observe: Callable[[str, float], None],
        refit_source: RefitSource | None = None,
        keep_weights: bool = False,
    ) -> VLLMEngine:
        client = VLLMClient(url, api_key=api_key, call_timeout_s=call_timeout_s, observe=observe)
        return cls(client, refit_source=refit_source, keep_weights=keep_weights)

    # --- presence --------------------------------------------------------------------------------------

    async def discover(self, timeout: float) -> Discovery:
        version = await self.client.version(timeout=timeout)
        quirks = VLLMQuirks.detect(version)
        if not quirks.is_supported:
            raise EngineUnsupported(
                f"vLLM {version} is not a version the agent drives (supported: {', '.join(SUPPORTED)}, the "
                "versions docs/vllm-conformance.md was read from); run one of them"
            )
        info = await self.client.server_info(timeout=timeout)
        self.client.quirks = quirks
        facts = VLLMFacts.from_server_info(
            version,
            info,
            refit_source=self._refit_source,
            keep_weights=self._keep_weights,
            exposed_at=await self._exposed(),
        )
        served = LAUNCH_LABEL
        if facts.dev_mode and quirks.carries_weight_version:
            served = await self.client.weight_version(timeout=timeout)
        self._facts = facts
        return Discovery(
            facts=facts, served=Served(served, facts.model), architectures=_architectures(facts.model)
        )

    async def _exposed(self) -> str | None:
        """Where vLLM's port also answers beyond loopback (V-LAUNCH-HOST: `--host` unset binds every
        interface), or None."""
        port = urlsplit(self.client.base_url).port
        if port is None:
            return None
        for host in outbound_addresses():
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), EXPOSURE_PROBE_S)
            except (OSError, TimeoutError):
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return f"{host}:{port}"
        return None

    async def liveness(self, timeout: float = 5.0) -> int:
        """V-HEALTH: `/health` answers while paused, asleep or blocked in a utility call."""
        return await self.client.health(timeout=timeout)

    async def hang_check(self) -> str | None:
        """V-DEATH-EXC: a dead engine core answers `/health` 503 until its API server exits (5 s), or for
        good with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1."""
        status = await self.client.health(timeout=5.0)
        if status == 503:
            return "vLLM's engine core is dead: /health answers 503 (V-DEATH-EXC)"
        return None

    # --- stop new work ---------------------------------------------------------------------------------

    async def stop_new_work(self, mode: DrainMode, dl: Deadline) -> None:
        """§8: `/pause?mode=abort|keep|wait`; its 200 comes once every DP rank drained (V-DRAIN-TIMING)."""
        await self._pause(PAUSE_MODES[mode], dl, "drain")

    async def _pause(self, mode: str, dl: Deadline, what: str) -> None:
        self._mode = mode
        try:
            await self.client.pause(mode, timeout=max(0.001, dl.remaining()))
        except TimeoutError as e:
            raise CommandFailed(
                f"{what}: /pause?mode={mode} did not return within {dl.seconds:g}s (requests still running)"
            ) from e
        except EngineError as e:
            raise CommandFailed(f"{what}: {e}") from e

    async def prove_idle(self, dl: Deadline, what: str, paused_by: DrainMode | None) -> None:
        """The pause is its own proof: vLLM completes it from the engine core's idle callback, on every DP
        rank (V-DRAIN-TIMING), so the same pause again answers once nothing runs anywhere. `/is_paused` and
        `/reset_prefix_cache` say less: 0.26 answers them for DP rank 0 only (V-DP-FANOUT)."""
        await self._pause(PAUSE_MODES[paused_by or DrainMode.ABORT], dl, what)

    # --- release and resume by part --------------------------------------------------------------------

    async def release(self, parts: Sequence[ReleaseTag], timeout: float) -> None:
        """The KV cache alone: `/release_kv_cache_memory` (0.34, V-MEM-RELEASE-KV). Weights and KV: `/sleep`
        at level 2 (the weights discarded: a refit follows) or, when the agent keeps released weights, level
        1 (copied to pinned host memory: V-MEM-LEVEL1-HOST), in the drain's pause mode. A sleep that
        failed may have unmapped memory the executor then believes mapped (V-KILL-SLEEP-ASSERT): no wake can
        be trusted after it."""
        tags = set(parts)
        if tags == {ReleaseTag.KV_CACHE}:
            await self.client.release_kv_cache(timeout=timeout)
            self._asleep.add(ReleaseTag.KV_CACHE)
            return
        level = HOST_COPY_LEVEL if self._keep_weights else DISCARD_LEVEL
        try:
            await self.client.sleep(level, self._mode, timeout=timeout)
        except EngineError as e:
            raise StateLost(
                f"sleep(level={level}) failed ({e.message}): the workers may have unmapped memory that "
                "vLLM's "
                "executor now believes mapped, so a wake would map nothing and schedule onto it "
                "(V-KILL-SLEEP-ASSERT)"
            ) from e
        self._asleep |= {ReleaseTag.WEIGHTS, ReleaseTag.KV_CACHE}

    async def resume(self, parts: Sequence[ReleaseTag], timeout: float) -> None:
        """One `/wake_up` of each part (the core sends each released part once: V-MEM-WAKE-DUP-TAG,
        V-KILL-WAKE-NOT-ASLEEP). Waking the last sleeping part resumes scheduling (V-MEM-WAKE-ORDER)."""
        awake = await self.client.wake_up([t.value for t in parts], timeout=timeout)
        self._asleep -= set(parts)
        if awake is not None and awake == bool(self._asleep):
            log.warning(
                "vLLM says it is %s after waking %s; the agent counts %s still asleep",
                "awake" if awake else "still sleeping",
                ", ".join(t.value for t in parts),
                ", ".join(t.value for t in self._asleep) or "nothing",
            )

    # --- load weights ----------------------------------------------------------------------------------

    async def load_from_disk(self, path: str, version: str, timeout: float) -> bool:
        """V-REFIT-DISK: `reload_weights` from `path` (a layerwise load: V-REFIT-LAYERWISE), then the prefix
        cache is reset, which the reload does not do: its reset touches only the scheduler's block table
        (block_pool.py:761-791@0.26.0), so it is safe while the KV cache sleeps. The version is labelled
        apart (`label_weights`)."""
        dl = Deadline(timeout)
        await self.client.reload_weights(path, timeout=timeout)
        await self.flush_prefix_cache(dl, None)
        return False

    async def label_weights(self, version: str, timeout: float, *, carried: bool) -> None:
        """V-ROUTE-WV: 0.34 takes the label with `/update_weight_version` (or a window's finish: `carried`);
        0.26 carries none, so the agent's state holds it (EngineInfo.servedVersionSource: Agent)."""
        quirks = self.client.q()
        if carried or not quirks.carries_weight_version:
            return
        await self.client.update_weight_version(version, timeout=timeout)

    async def open_weight_update(self, dl: Deadline) -> None:
        """V-ROUTE-WT-INIT once per vLLM process (the IPC init has no rendezvous: sent again after the
        agent's restart, it changes nothing), then V-ROUTE-WT-SESSION's start. Every push is one packed
        buffer: 0.34 takes `packed` at the init, 0.26 in each update (V-REFIT-IPC)."""
        quirks = self.client.q()
        self._final_version = None
        if not self._transfer_ready:
            init = {"packed": True} if quirks.packed_in_init_info else {}
            await self.client.init_weight_transfer(init, timeout=max(0.001, dl.remaining()))
            self._transfer_ready = True
        try:
            await self.client.start_weight_update(timeout=max(0.001, dl.remaining()))
        except EngineError as e:
            if "already active" not in e.message:
                raise
            # A session a failed window left open: finish it (layers that received nothing get their old
            # tensors back, V-REFIT-LAYERWISE), then start clean.
            log.warning("a weight-update session was still active; finishing it first")
            await self.client.finish_weight_update(None, timeout=max(0.001, dl.remaining()))
            await self.client.start_weight_update(timeout=max(0.001, dl.remaining()))

    async def push_tensors(self, push: TensorPush, version: str | None, timeout: float) -> str:
        """V-ROUTE-WT-UPDATE with the trainer's packed `update_info` (checked by the guards), `packed` set
        where the version reads it; the final push's version is labelled at the finish."""
        assert push.update_info is not None  # VLLMGuards.tensor_push refused any other push
        info = {k: v for k, v in push.update_info.items() if k != "packed"}
        if not self.client.q().packed_in_init_info:
            info["packed"] = True
        if version is not None:
            self._final_version = version
        return await self.client.update_weights(info, timeout=timeout)

    async def close_weight_update(self, timeout: float) -> None:
        """V-ROUTE-WT-SESSION's finish: the layers are built (V-REFIT-LAYERWISE) and, from 0.27, labelled."""
        try:
            await self.client.finish_weight_update(self._final_version, timeout=timeout)
        except (EngineError, TimeoutError) as e:
            raise CommandFailed(f"finish_weight_update failed: {e}") from e

    async def join_weights_group(self, group: InitWeightsGroup, timeout: float) -> str:
        raise CommandFailed(DISTRIBUTED)  # the guards refuse first

    async def push_distributed(self, push: DistributedPush, version: str | None, timeout: float) -> str:
        raise CommandFailed(DISTRIBUTED)  # the guards refuse first

    # --- flush and continue ----------------------------------------------------------------------------

    async def flush_prefix_cache(self, dl: Deadline, paused_by: DrainMode | None) -> None:
        """V-ROUTE-FLUSH until `success` (false while any KV block is held: V-KILL-FLUSH-HELD)."""
        backoff = 0.02
        while True:
            try:
                if await self.client.reset_prefix_cache(timeout=max(0.001, dl.remaining())):
                    return
            except TimeoutError as e:
                raise CommandFailed(f"/reset_prefix_cache did not answer within {dl.seconds:g}s") from e
            except EngineError as e:
                raise CommandFailed(str(e)) from e
            if dl.remaining() <= 0:
                raise CommandFailed(
                    f"vLLM did not reset its prefix cache within {dl.seconds:g}s (KV blocks held)"
                )
            await asyncio.sleep(min(backoff, dl.remaining()))
            backoff = min(backoff * 2, 0.5)

    async def continue_serving(self, dl: Deadline, on_continued: Callable[[], None]) -> Served:
        """The last wake resumed scheduling already (V-MEM-WAKE-ORDER); after a drain with no sleep,
        `/resume` does (V-ROUTE-RESUME: it also lifts 0.34's refusal of new requests). Never while a part
        sleeps (V-KILL-RESUME-ASLEEP). Then one generated token proves it serves; on 0.34 it goes out after
        the resume (a paused 0.34 answers 503: V-REQ-PAUSED)."""
        if self._asleep:
            raise CommandFailed(
                f"not continuing: vLLM still sleeps {', '.join(t.value for t in sorted(self._asleep))} and "
                "/resume would schedule onto unmapped memory (V-KILL-RESUME-ASLEEP)"
            )
        try:
            await self.client.resume(timeout=max(0.001, dl.remaining()))
        except TimeoutError as e:
            raise CommandFailed("/resume did not answer before the deadline") from e
        except EngineError as e:
            raise CommandFailed(str(e)) from e
        on_continued()
        model = (self._facts.served_model_name or self._facts.model) if self._facts else None
        try:
            await self.client.generate_probe(model or "", timeout=max(1.0, dl.remaining()))
        except TimeoutError as e:
            raise CommandFailed(f"vLLM generated no token within {dl.seconds:g}s of the resume") from e
        except EngineError as e:
            raise CommandFailed(f"vLLM cannot generate after the resume: {e}") from e
        try:
            return await self.served(timeout=max(1.0, dl.remaining()))
        except (EngineError, TimeoutError) as e:
            raise CommandFailed(f"cannot read the served weight_version: {e}") from e

    # --- read what it serves ---------------------------------------------------------------------------

    async def served(self, timeout: float) -> Served:
        """V-ROUTE-WV: 0.34's `/weight_info`; 0.26 carries no label (None: the agent's is the served one).
        No route gives the checkpoint a reload read (its `model_config` is the worker's, not
        /server_info's)."""
        if not self.client.q().carries_weight_version:
            return Served(None, None)
        return Served(await self.client.weight_version(timeout=timeout), None)

    async def read_load(self, timeout: float = 5.0) -> LoadSample:
        """V-METRIC-PROM over the DP ranks: running and waiting requests (the last step's gauges), and since
        the previous read the prefix-cache hit rate (hits over queries, in tokens) and the generation
        throughput (generated tokens per second)."""
        series = metrics.parse_metrics(await self.client.metrics(timeout=timeout))
        now = time.monotonic()
        previous, self._last_load = self._last_load, (now, series)
        sample = LoadSample(
            running=series.get("vllm:num_requests_running"), waiting=series.get("vllm:num_requests_waiting")
        )
        if previous is None or "vllm:prompt_tokens_total" not in series:
            return sample
        then, before = previous

        def grew(name: str) -> float:
            return max(0.0, series.get(name, 0.0) - before.get(name, 0.0))

        queries = grew("vllm:prefix_cache_queries_total")
        rate = grew("vllm:prefix_cache_hits_total") / queries if queries > 0 else None
        tput = grew("vllm:generation_tokens_total") / (now - then) if now > then else None
        return LoadSample(sample.running, sample.waiting, cache_hit_rate=rate, gen_throughput=tput)

    async def read_counters(self, timeout: float = 5.0) -> dict[Counter, float] | None:
        return metrics.counters(metrics.parse_metrics(await self.client.metrics(timeout=timeout)))

    async def read_weights(self, weights_released: bool, timeout: float) -> Look:
        return await look(self.client, weights_released, timeout)

    # --- plumbing --------------------------------------------------------------------------------------

    def framework_endpoint(
        self, store: StateStore, lease: LeaseDesk, windows: RefitWindows, refit_source: RefitSource | None
    ) -> web.Application:
        """The vLLM-compatible endpoint a framework is pointed at instead of vLLM (endpoint.py)."""
        return build_app(VLLMEndpoint(store, lease, windows, self.client, refit_source))


def _architectures(model: str | None) -> tuple[str, ...]:
    """The launch checkpoint's architectures (its config.json, where the model is a local directory): how
    the SDK's digest maps pushed tensors to vLLM's parameters. vLLM's /server_info does not list them."""
    if model is None:
        return ()
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    archs = config.get("architectures") if isinstance(config, dict) else None
    return tuple(str(a) for a in archs) if isinstance(archs, list) else ()
