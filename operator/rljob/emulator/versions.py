"""What changed between the emulated SGLang versions. One profile per version string.

Every property cites the wheel source it was read from (`path:line@version`, path relative to the wheel
root, `…/` = `sglang/srt/`); the row IDs are those of docs/sglang-conformance.md. Where a boundary falls
between two versions that were read, the property uses the first version that has the behaviour."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The versions whose behaviour docs/sglang-conformance.md records: the only ones the emulator accepts.
RECORDED_VERSIONS = ("0.5.6", "0.5.10.post1", "0.5.15.post1", "0.5.20", "0.5.21", "0.5.23")
# The recorded versions the version-parametrized tests run every row on. 0.5.10.post1, recorded for AReaL's
# replay, has targeted tests instead (the last section of tests/agent/test_emulator_conformance.py).
SUPPORTED_VERSIONS = tuple(v for v in RECORDED_VERSIONS if v != "0.5.10.post1")
DEFAULT_VERSION = "0.5.23"

# The three idle predicates of C-IDLE-FLUSH / C-IDLE-RELEASE.
IDLE_IGNORES_WAITING = "ignores_waiting"  # 0.5.6 _is_no_request(): the waiting queue never counts
IDLE_STRICT = "strict"  # is_fully_idle(): waiting requests always count
IDLE_IGNORES_WAITING_WHEN_PAUSED = "ignores_waiting_when_paused"  # is_fully_idle(ignore_waiting=paused)


def version_key(version: str) -> tuple[int, int, int]:
    """`0.5.15.post1` -> (0, 5, 15); post/rc suffixes do not change behaviour here."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not an SGLang version: {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def check_recorded(version: str) -> str | None:
    """None for a recorded version, else the startup error naming the nearest recorded ones."""
    if version in RECORDED_VERSIONS:
        return None
    recorded = ", ".join(RECORDED_VERSIONS)
    try:
        key = (*version_key(version), post_release(version))
    except ValueError:
        return f"--sglang-version {version!r} is not an SGLang version; recorded: {recorded}"
    keyed = [((*version_key(v), post_release(v)), v) for v in RECORDED_VERSIONS]
    below = [v for k, v in keyed if k < key]
    above = [v for k, v in keyed if k > key]
    nearest = " and ".join(x for x in (below[-1] if below else "", above[0] if above else "") if x)
    return (
        f"--sglang-version {version}: its behaviour is not recorded in docs/sglang-conformance.md "
        f"(nearest recorded: {nearest}; recorded: {recorded})"
    )


def post_release(version: str) -> int:
    """`0.5.6.post2` -> 2, `0.5.6` -> 0."""
    m = re.search(r"\.post(\d+)$", version)
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class VersionProfile:
    version: str

    @property
    def key(self) -> tuple[int, int, int]:
        return version_key(self.version)

    def _at_least(self, patch: int) -> bool:
        return self.key >= (0, 5, patch)

    # --- routes (C-ROUTE-*) ----------------------------------------------------------------------

    @property
    def get_weight_version(self) -> str:
        """C-ROUTE-WV-READ: "ok" (0.5.6), "deprecated" (404 naming /model_info), "removed" (plain 404)."""
        # …/entrypoints/http_server.py:497-527@0.5.6; http_server.py:581-588@0.5.10.post1;
        # http_server.py:685-692@0.5.15.post1; http_server.py:798-799@0.5.20;
        # absent from http_server.py@0.5.21
        if not self._at_least(10):
            return "ok"
        return "deprecated" if not self._at_least(21) else "removed"

    @property
    def get_load(self) -> str:
        """C-METRIC-LOAD-ROUTE: "list" (0.5.6), "shim" over /v1/loads (0.5.15 to 0.5.20), "removed"."""
        # http_server.py:560-562@0.5.6; still the scheduler call: http_server.py:621-628,
        # …/managers/tokenizer_communicator_mixin.py:889-892@0.5.10.post1;
        # http_server.py:730-755@0.5.15.post1; absent@0.5.21
        if not self._at_least(15):
            return "list"
        return "shim" if not self._at_least(21) else "removed"

    @property
    def has_v1_loads(self) -> bool:
        # …/entrypoints/v1_loads.py:130@0.5.8 (first read), v1_loads.py:130@0.5.10.post1,
        # v1_loads.py:72@0.5.15.post1; no such route in http_server.py@0.5.6
        return self._at_least(8)

    @property
    def v1_loads_snapshot_layout(self) -> bool:
        """C-METRIC-LOAD-ROUTE: 0.5.15.post1's reply is {timestamp, version, loads} and each load has 12
        core keys; from 0.5.20 the reply adds `accelerator`, `num_accelerators` and each load is every
        scalar field of LoadSnapshot: `timestamp` first, `num_active_tokens`, `num_prealloc_ready_tokens`,
        `total_prefill_uncached_tokens`, `total_prefill_busy_us`, `decode_moments` added."""
        # …/entrypoints/v1_loads.py:115-123@0.5.15.post1, …/managers/load_snapshot.py:292-306@0.5.15.post1;
        # v1_loads.py:144-155@0.5.20, load_snapshot.py:192-217,228-260@0.5.20 (the same at
        # load_snapshot.py:192-217@0.5.21, v1_loads.py:144-149@0.5.21); load_snapshot.py:196-221,262-264,
        # v1_loads.py:144-149@0.5.23
        return self._at_least(20)

    @property
    def memory_usage_per_phase(self) -> bool:
        """C-MEM-USAGE-REPORT: `internal_states[*].memory_usage` of /server_info has `weight`, `kvcache`
        and `graph` in GB of 2^30 bytes per GPU, rounded to 2 places with `graph` one number up to
        0.5.15.post1; from 0.5.20 rounded to 3 places with `startup_available`, `token_capacity_swa` and
        `graph` per capture phase."""
        # …/managers/scheduler.py:2257-2270@0.5.6; scheduler.py:3770-3780@0.5.15.post1;
        # scheduler.py:5026-5034@0.5.20, …/managers/scheduler_components/memory_usage.py:15-41@0.5.20;
        # scheduler.py:5232-5241@0.5.21; …/managers/scheduler_components/internal_state.py:76-89@0.5.23,
        # memory_usage.py:15-41@0.5.23, …/model_executor/graph_memory_usage.py:5-12@0.5.23
        return self._at_least(20)

    @property
    def metrics_middleware_reads_route_path(self) -> bool:
        """C-METRIC-LOAD-ASGI: with --enable-metrics SGLang's request-metrics middleware reads `route.path` of
        every route in order; under FastAPI >= 0.137 the included router that holds `/v1/loads` is an
        `_IncludedRouter` without one, so that route answers 500. 0.5.20 reads it with a default."""
        # utils/common.py:2379-2387@0.5.15.post1; getattr(route, "path", ...) in utils/common.py:2742@0.5.20
        return self.has_v1_loads and not self._at_least(20)

    @property
    def loads_frozen_while_paused(self) -> bool:
        """C-DP-LOADS-PAUSED: the load route reads snapshots each scheduler publishes from its loop, and a
        paused (retract / in_place) scheduler skips the publish: its counts stay at their pre-pause values.
        0.5.6's `/get_load` asks the schedulers (a watching call), and so do both routes of 0.5.10.post1."""
        # tokenizer_communicator_mixin.py:889-920@0.5.10.post1 (communicator calls);
        # scheduler.py:1551@0.5.15.post1, scheduler.py:1914-1916@0.5.21, scheduler.py:2033-2036@0.5.23
        return self._at_least(15)

    @property
    def has_ready(self) -> bool:
        # C-HEALTH-READY: http_server.py:662@0.5.20
        return self._at_least(20)

    @property
    def ready_is_open(self) -> bool:
        """`/ready*` needs no key (with /health* and /metrics*)."""
        # …/utils/auth.py:101-106@0.5.20 (auth.py:100@0.5.15.post1 exempts only /health, /metrics)
        return self._at_least(20)

    @property
    def has_admin_api_key(self) -> bool:
        # C-ROUTE-AUTH: …/utils/auth.py:100@0.5.10.post1 (the same file@0.5.15.post1);
        # utils/common.py:1189-1200@0.5.6 has one key
        return self._at_least(10)

    @property
    def needs_weight_update_session(self) -> bool:
        # C-ROUTE-SESSION: http_server.py:1400,1415@0.5.21
        return self._at_least(21)

    @property
    def checker_get_and_default_action(self) -> bool:
        """C-ROUTE-CHECKER: GET|POST and `action` defaulting to "checksum" (0.5.6: POST, action required)."""
        # http_server.py:961@0.5.6, io_struct.py:1315-1316@0.5.6; still so at http_server.py:1193,
        # io_struct.py:1453-1454@0.5.10.post1; http_server.py:1398@0.5.15.post1
        return self._at_least(15)

    @property
    def checker_actions(self) -> tuple[str, ...]:
        """C-CHECKER-CHECKSUM: what /weights_checker's `action` may be; `checksum` from 0.5.15.post1."""
        # utils/weight_checker.py:19-28@0.5.6 (still so in the 0.5.10.post1 wheel);
        # utils/weight_checker.py:75-84@0.5.15.post1
        old = ("snapshot", "reset_tensors", "compare")
        return (*old, "checksum") if self._at_least(15) else old

    @property
    def checker_roles(self) -> bool:
        """C-CHECKER-CHECKSUM: a rank's `parallelism_info` is a list, one per role (`target`, drafts)."""
        # managers/io_struct.py:2019-2033@0.5.20 (one object); io_struct.py:2128-2145@0.5.21
        return self._at_least(21)

    @property
    def update_weight_version_reaches_scheduler(self) -> bool:
        """`/update_weight_version` waits for the scheduler (it records the change for the spans)."""
        # tokenizer-only: http_server.py:896-923@0.5.6, http_server.py:1325-1345@0.5.15.post1;
        # update_weight_version_communicator: …/managers/tokenizer_control_mixin.py:931-936@0.5.20
        return self._at_least(20)

    @property
    def model_info_keys(self) -> tuple[str, ...]:
        """C-ROUTE-MODEL-INFO: the keys of `/model_info` (and `/get_model_info`), in the order SGLang's dict
        literal writes them."""
        # …/entrypoints/http_server.py:501-507@0.5.6; http_server.py:670-679@0.5.15.post1 (model_type and
        # architectures added; weight_version written twice, so it keeps its first place);
        # http_server.py:765-785@0.5.20 (served_model_name, load_format, reasoning_parser,
        # tool_call_parser); http_server.py:795-818@0.5.21, http_server.py:817-840@0.5.23
        # (disaggregation_mode)
        head: tuple[str, ...] = ("model_path", "tokenizer_path", "is_generation", "preferred_sampling_params")
        head += ("weight_version",)
        understanding = ("has_image_understanding", "has_audio_understanding")
        if not self._at_least(15):
            return head + understanding
        hf = ("model_type", "architectures")
        if not self._at_least(20):
            return head + understanding + hf
        head = (head[0], "served_model_name", *head[1:])
        parsers = ("load_format", "reasoning_parser", "tool_call_parser")
        if self._at_least(21):
            parsers += ("disaggregation_mode",)
        return head + parsers + understanding + hf

    # --- /generate meta_info (C-GEN-META) ----------------------------------------------------------

    @property
    def meta_cached_tokens_details(self) -> bool:
        """`cached_tokens_details` after `cached_tokens` on every answer: None, or {"device", "host"}."""
        # …/managers/scheduler_components/output_streamer.py:60-88,197,384@0.5.15.post1,
        # …/managers/tokenizer_manager.py:1922-1929@0.5.15.post1; output_streamer.py:85@0.5.20,
        # tokenizer_manager.py:2418@0.5.20; output_streamer.py:102@0.5.23, tokenizer_manager.py:2574@0.5.23
        return self._at_least(15)

    @property
    def meta_request_timestamps(self) -> bool:
        """With --enable-metrics the last answer adds, after `e2e_latency`, `request_received_ts`,
        `api_server_dispatch_finish_ts`, `response_sent_to_client_ts` (a stream's first chunk already
        went), `request_finished_ts` and `decode_throughput` = (completion_tokens - 1) / decode latency
        when completion_tokens > 1; every answer has `queue_time` after the retractions key. 0.5.6 writes
        another set (tokenizer_manager.py:1592-1600,1884-1928@0.5.6), not emulated."""
        # …/observability/req_time_stats.py:471-495,1150-1167@0.5.15.post1, tokenizer_manager.py:1898-1900,
        # 2091-2110@0.5.15.post1; tokenizer_manager.py:2362,2587-2606@0.5.20;
        # tokenizer_manager.py:2518,2753-2772@0.5.23
        return self._at_least(15)

    @property
    def meta_first_token_latency(self) -> bool:
        """`first_token_latency` after `request_received_ts`."""
        # req_time_stats.py:502-503@0.5.21, req_time_stats.py:515-516@0.5.23; absent@0.5.20
        return self._at_least(21)

    @property
    def meta_scheduler_timestamps(self) -> bool:
        """The scheduler's time stats reach the tokenizer through the detokenizer: 0.5.15.post1's second
        hop pickles them as {} (no `enable_metrics` in the state), so `queue_time` is 0.0 and neither
        `forward_entry_time` nor `prefill_finished_time` shows; from 0.5.20 `has_timing_data` carries them,
        so both show and `queue_time` is the real queue wait."""
        # req_time_stats.py:317-330,629-640,1030-1031@0.5.15.post1; req_time_stats.py:651-662,1053-1054,
        # 1177-1190@0.5.20; req_time_stats.py:1044-1045,1161-1174@0.5.21; req_time_stats.py:677-700,
        # 1096-1097,1213-1235@0.5.23
        return self._at_least(20)

    @property
    def meta_storage_waits(self) -> bool:
        """`storage_prefetch_wait` and `storage_staging_wait` (0.0 without HiCache storage) before
        `forward_entry_time`."""
        # req_time_stats.py:677-700,776-781,1213-1222@0.5.23; not in req_time_stats.py:651-662@0.5.21
        return self._at_least(23)

    # --- drain and idle (C-DRAIN-*, C-IDLE-*) ----------------------------------------------------

    @property
    def idle_predicate(self) -> str:
        """The non-deferred flush's predicate, which release and the post-refit flush assert too."""
        # …/managers/scheduler.py:2205-2228@0.5.6 (_is_no_request: no waiting-queue clause);
        # scheduler.py:3585-3603,3740-3742@0.5.15.post1 (is_fully_idle(): waiting counts), the same at
        # scheduler.py:4808-4824,4981-4983@0.5.20; is_fully_idle appears in scheduler.py@0.5.10;
        # scheduler.py:5011-5029,5187-5189@0.5.21 (ignore_waiting=_engine_paused)
        if not self._at_least(10):
            return IDLE_IGNORES_WAITING
        return IDLE_STRICT if not self._at_least(21) else IDLE_IGNORES_WAITING_WHEN_PAUSED

    @property
    def idle_assert_text(self) -> str:
        # …/managers/scheduler_update_weights_mixin.py:113-116@0.5.6;
        # …/managers/scheduler_components/weight_updater.py:185-187@0.5.15.post1
        if not self._at_least(10):
            return "release_memory_occupation should be called only when no ongoing request."
        return "release_memory_occupation should be called only when server is idle."

    @property
    def flush_cache_takes_timeout(self) -> bool:
        """C-IDLE-FLUSH-DEFERRED: `?timeout=` defers the flush until idle; older versions ignore it."""
        # io_struct.py:1125@0.5.10, http_server.py:720@0.5.10; http_server.py:862-877@0.5.15.post1;
        # …/managers/scheduler_components/flush_wrapper.py:23-66@0.5.15.post1
        return self._at_least(10)

    @property
    def retract_zeroes_gen_throughput(self) -> bool:
        """A retract pause sets last_gen_throughput = 0.0 (an in_place pause returns before that)."""
        # scheduler.py:4052@0.5.15.post1 (first in scheduler.py@0.5.14), scheduler.py:5928@0.5.23
        return self._at_least(14)

    # --- memory (C-MEM-*) ------------------------------------------------------------------------

    @property
    def has_weight_cache(self) -> bool:
        # C-MEM-WEIGHT-CACHE: weight_updater.py:196-210@0.5.20 (no weight cache in 0.5.15.post1)
        return self._at_least(19)

    @property
    def breakable_prefill_rejects_memory_saver_graph(self) -> bool:
        """C-MEM-CUDAGRAPH-ENV: the default CUDA prefill backend is breakable, whose __init__ raises under
        --enable-memory-saver with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1."""
        # …/model_executor/runner_backend/breakable_cuda_graph_backend.py:77-86@0.5.15.post1,
        # …/model_executor/cuda_graph_config.py:95-101@0.5.15.post1; cuda_graph_config.py:119-123@0.5.23;
        # 0.5.6 has no breakable backend (…/model_executor/cuda_graph_runner.py:515-527@0.5.6)
        return self._at_least(15)

    @property
    def prefill_graph_backends(self) -> tuple[str, ...]:
        """Choices of --cuda-graph-backend-prefill (the flag does not exist on 0.5.6)."""
        # …/model_executor/cuda_graph_config.py:38-45@0.5.15.post1 (Backend.ALL),
        # cuda_graph_config.py:47@0.5.21; cuda_graph_config.py:48@0.5.23 and
        # …/arg_groups/fields/exec_.py:621-628@0.5.23: no tc_piecewise
        if not self._at_least(15):
            return ()
        if not self._at_least(23):
            return ("full", "breakable", "tc_piecewise", "disabled")
        return ("full", "breakable", "disabled")

    # --- refit (C-REFIT-*) -----------------------------------------------------------------------

    @property
    def refit_flush_failure_is_fatal(self) -> bool:
        """C-REFIT-FLUSH-FAIL: ≤0.5.21 asserts "Cache flush failed after updating weights"; from 0.5.22
        the update returns success:false."""
        # weight_updater.py:101-106@0.5.15.post1, weight_updater.py:117-122@0.5.21,
        # weight_updater.py:120-132@0.5.22
        return not self._at_least(22)

    @property
    def distributed_unknown_group_is_fatal(self) -> bool:
        """C-REFIT-GROUP-UNKNOWN: ≤0.5.20 asserts the group exists outside any try; from 0.5.21 the
        assert sits inside the scheduler's try and the call returns success:false."""
        # model_runner.py:1165-1168@0.5.6, tp_worker.py:152-161@0.5.6;
        # …/model_runner_components/weight_updater.py:245-248@0.5.20,
        # scheduler_components/weight_updater.py:144-153@0.5.20 (no try);
        # scheduler_components/weight_updater.py:188-198@0.5.21 (try/except Exception)
        return not self._at_least(21)

    @property
    def tensor_bad_base64_is_fatal(self) -> bool:
        """C-REFIT-TENSOR-B64: 0.5.6 decodes each payload inside the scheduler with
        `b64decode(validate=True)` and no try: text that is not base64 raises binascii.Error and kills
        it. From 0.5.15 the HTTP body decodes it (`Base64Bytes`): a validation error, 400."""
        # tp_worker.py:164-172@0.5.6, utils/common.py:2211-2215@0.5.6, io_struct.py:1288@0.5.10.post1
        # (still List[Union[str, bytes]]); io_struct.py:1570@0.5.15.post1, utils/msgspec_utils.py:11-27
        # @0.5.15.post1
        return not self._at_least(15)

    @property
    def refit_paused_sets_weight_version(self) -> bool:
        """C-REFIT-WV-PAUSED: 0.5.6 returns before `_update_weight_version_if_provided` while paused."""
        # …/managers/tokenizer_manager.py:1299-1316@0.5.6,
        # tokenizer_communicator_mixin.py:418-436,479-495@0.5.6; fixed in tokenizer_manager.py:1214-1223
        # @0.5.6.post2
        return self.key > (0, 5, 6) or post_release(self.version) >= 2

    @property
    def dp_refit_allowed_with_dp_attention(self) -> bool:
        """C-REFIT-DP: the tokenizer asserts `dp_size == 1 or enable_dp_attention` up to 0.5.21, then
        `dp_size == 1`."""
        # tokenizer_communicator_mixin.py:385-387,411-413,472-474@0.5.6;
        # tokenizer_control_mixin.py:451,464,509,569@0.5.23
        return not self._at_least(23)

    @property
    def has_weight_versions_spans(self) -> bool:
        # …/utils/weight_versions.py@0.5.20 (absent@0.5.15.post1); spans end exclusive: :63-106@0.5.23
        return self._at_least(19)

    # --- health and death (C-HEALTH-*, C-DEATH-*) -----------------------------------------------

    @property
    def ping_reflects_health(self) -> bool:
        """C-HEALTH-PING: `/ping` is a constant 200 through 0.5.22; 0.5.23 answers is_healthy()."""
        # http_server.py:1315-1318@0.5.6, http_server.py:2095-2098@0.5.21; http_server.py:2190-2199@0.5.23
        return self._at_least(23)

    @property
    def subprocess_watchdog(self) -> bool:
        """C-DEATH-HARD: a scheduler that dies without a Python exception takes the server down (≥0.5.10);
        on 0.5.6 the HTTP server stays up and every call to the scheduler hangs."""
        # …/utils/watchdog.py:166-223@0.5.10, …/entrypoints/engine.py:743-746@0.5.10; absent@0.5.6
        return self._at_least(10)

    @property
    def health_skips_when_released(self) -> bool:
        """C-HEALTH-RELEASED: the scheduler drops health probes while any tag is released."""
        # scheduler.py:1173-1181@0.5.6 (len(self.offload_tags) > 0); gone in scheduler.py@0.5.10,
        # scheduler.py:1677-1684@0.5.15.post1
        return not self._at_least(10)

    # --- metrics (C-METRIC-*) --------------------------------------------------------------------

    @property
    def has_moe_ep_rank_label(self) -> bool:
        # scheduler labels: absent in scheduler_metrics_mixin.py:64-71@0.5.6, present in
        # scheduler_metrics_mixin.py@0.5.8 and …/observability/metrics_collector.py:1061@0.5.15.post1
        return self._at_least(8)

    @property
    def tokenizer_labels_have_engine_type(self) -> bool:
        # tokenizer_manager.py:383-390@0.5.6 ({model_name}); tokenizer_manager.py:534-537@0.5.15.post1
        return self._at_least(15)

    @property
    def cached_tokens_have_cache_source(self) -> bool:
        # …/observability/metrics_collector.py:1170-1174,1331-1355@0.5.10.post1,
        # metrics_collector.py:1509-1511,1655-1661@0.5.15.post1; collector.py:807-810@0.5.6 (no such label)
        return self._at_least(10)

    @property
    def request_counters_have_is_streaming(self) -> bool:
        # metrics_collector.py:1559-1566,1644-1646,1795-1799@0.5.20 (none in
        # metrics_collector.py:1430-1437@0.5.15.post1)
        return self._at_least(20)

    @property
    def has_weight_load_duration_metric(self) -> bool:
        # C-METRIC-PROM: metrics_collector.py:399-400,1147@0.5.15.post1; not in …/metrics/collector.py@0.5.6
        return self._at_least(15)

    @property
    def device_timer_metric(self) -> tuple[str, str] | None:
        """C-METRIC-DEVICE-TIMER: the counter of forward-pass GPU seconds SGLang serves with
        SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 (its name without `_total`) and its decode passes' `category`,
        or None where it has none."""
        # …/observability/metrics_collector.py:689-690@0.5.10.post1,
        # scheduler_metrics_mixin.py:1036@0.5.10.post1 ("forward_" + the mode);
        # metrics_collector.py:878-879@0.5.15.post1,
        # …/model_executor/runner/eager_runner.py:245@0.5.15.post1; no device timer in 0.5.6
        if not self._at_least(10):
            return None
        if not self._at_least(15):
            return "gpu_execution_seconds", "forward_decode"
        return "forward_execution_seconds", "decode"
