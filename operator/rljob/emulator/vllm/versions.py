"""What differs between the emulated vLLM versions, one property per difference.

Each property cites the wheel source it was read from (`path:line@version`, path relative to the wheel
root, `…/` = `vllm/`); row IDs are those of docs/vllm-conformance.md. Only the two recorded versions are
accepted: nothing between 0.27.0 and 0.34.0 was read."""

from __future__ import annotations

import re
from dataclasses import dataclass

RECORDED_VERSIONS = ("0.26.0", "0.34.0")
DEFAULT_VERSION = "0.26.0"


def check_recorded(version: str) -> str | None:
    """None for a recorded version, else the startup error naming the recorded ones."""
    if version in RECORDED_VERSIONS:
        return None
    return (
        f"--vllm-version {version}: its behaviour is not recorded in docs/vllm-conformance.md "
        f"(recorded: {', '.join(RECORDED_VERSIONS)})"
    )


def version_key(version: str) -> tuple[int, int, int]:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@dataclass(frozen=True)
class VllmProfile:
    version: str

    @property
    def key(self) -> tuple[int, int, int]:
        return version_key(self.version)

    @property
    def _rl_router(self) -> bool:
        """0.34 moved the pause and weight routes to …/entrypoints/rl/online/api_router.py."""
        return self.key >= (0, 34, 0)

    # --- routes (V-LAUNCH-DEVMODE, V-ROUTE-*) -----------------------------------------------------

    @property
    def has_release_kv_route(self) -> bool:
        """V-ROUTE-RELEASE-KV: sleep:38-45@0.34.0; absent from sleep/api_router.py@0.26.0."""
        return self._rl_router

    @property
    def has_weight_version(self) -> bool:
        """V-ROUTE-WV: /weight_info and /update_weight_version from 0.27.0 (rlhf:214-226@0.27.0)."""
        return self._rl_router

    @property
    def has_weight_checker(self) -> bool:
        """V-ROUTE-CHECKER: rl:232-266@0.34.0."""
        return self._rl_router

    @property
    def has_shutdown_weight_transfer(self) -> bool:
        """V-ROUTE-WT-SHUTDOWN: rl:174-178@0.34.0."""
        return self._rl_router

    @property
    def pause_takes_wait_for_inflight(self) -> bool:
        """V-ROUTE-PAUSE: `wait_for_inflight_requests` (deprecated `mode=wait`): rlhf:33@0.26.0; gone from
        rl:31-36@0.34.0."""
        return not self._rl_router

    @property
    def body_must_be_object(self) -> bool:
        """V-ROUTE-ABORT, V-ROUTE-RPC: 0.34 answers 400 for a JSON body that is not an object
        (rl:109-112@0.34.0, rpc:32-36@0.34.0); 0.26 calls `body.get` on it (AttributeError: 500)."""
        return self._rl_router

    @property
    def weight_bodies_validated(self) -> bool:
        """V-ROUTE-WT-INIT, V-ROUTE-WT-UPDATE, V-ROUTE-WT-SESSION: 0.34 declares `init_info`,
        `update_info`, `weight_version` as embedded body fields (rl:162-214@0.34.0: FastAPI validation,
        400); 0.26 reads `raw_request.json()` and checks for None (rlhf:157-202@0.26.0)."""
        return self._rl_router

    @property
    def sleep_level_range_checked(self) -> bool:
        """V-ROUTE-SLEEP: `Query(ge=0, le=2)` at sleep:29@0.34.0; `int(level)` at sleep:24-26@0.26.0."""
        return self._rl_router

    @property
    def sleep_and_wake_answer_json(self) -> bool:
        """V-ROUTE-SLEEP, V-ROUTE-WAKE: 0.34 answers {"status": ...} (sleep:35,57-59@0.34.0); 0.26 an empty
        200 (sleep:29,42@0.26.0)."""
        return self._rl_router

    # --- engine behaviour ------------------------------------------------------------------------

    @property
    def paused_requests_refused(self) -> bool:
        """V-REQ-PAUSED: after /pause?mode=abort|wait new requests get a retryable 503 until a resume
        (core:2002-2023,2456-2469@0.34.0); 0.26 queues them (no check in alm:280-415@0.26.0)."""
        return self._rl_router

    @property
    def dp_combines_answers(self) -> bool:
        """V-DP-FANOUT: 0.34 ANDs reset_prefix_cache and wake_up, and requires is_paused, is_sleeping and
        the weight version to agree (cc:1385-1459@0.34.0); 0.26 returns the first engine's answer
        (cc:1449-1457@0.26.0)."""
        return self._rl_router

    @property
    def executor_sleep_skips_on_any_tag(self) -> bool:
        """V-MEM-SLEEP-TWICE: 0.26 skips a sleep while any tag sleeps (exe:318-321@0.26.0: `is_sleeping`,
        cleared only once every tag woke); 0.34 only while `weights` sleeps (exe:437-440@0.34.0)."""
        return not self._rl_router

    @property
    def level_two_loses_buffers_above(self) -> int | None:
        """V-MEM-LEVELS, V-KILL-L3: 0.26 saves the model's buffers only at level 2 (gw:196-205@0.26.0), so
        a level >= 3 sleep loses them for good; 0.34 refuses levels outside 0..2 (sleep:29@0.34.0)."""
        return None if self._rl_router else 3

    @property
    def level_one_backup_kept(self) -> bool:
        """V-MEM-LEVEL1-HOST: 0.34 keeps the host backup of level 1 after the wake (cumem:70-89,320-332
        @0.34.0); 0.26 drops it at the wake (cumem:299-307@0.26.0)."""
        return self._rl_router

    @property
    def wake_records_awake_only_when_fully_awake(self) -> bool:
        """V-METRIC-PROM: 0.26 records the sleep state awake after any wake (alm:939-943@0.26.0); 0.34
        only once nothing sleeps (alm:1229-1235@0.34.0)."""
        return self._rl_router

    @property
    def packed_in_init_info(self) -> bool:
        """V-REFIT-IPC: `packed` moved from the IPC update info (ipc:72-132@0.26.0) to its init info
        (ipc:36-44@0.34.0)."""
        return self._rl_router

    @property
    def ipc_init_fields(self) -> dict[str, object]:
        """V-ROUTE-WT-INIT: IPCWeightTransferInitInfo fields and defaults (ipc:65-69@0.26.0,
        ipc:36-44@0.34.0)."""
        return {"packed": False} if self._rl_router else {}

    @property
    def nccl_init_fields(self) -> tuple[tuple[str, ...], dict[str, object]]:
        """V-REFIT-NCCL: NCCLWeightTransferInitInfo (required, optional with defaults): nccom:23-30
        @0.26.0; nccom:76-120@0.34.0 (kw_only)."""
        required = ("master_address", "master_port", "rank_offset", "world_size")
        if not self._rl_router:
            return required, {}
        return ("rank_offset", "world_size"), {
            "master_address": None,
            "master_port": None,
            "nccl_unique_id_b64": None,
            "packed": False,
            "packed_buffer_size_bytes": 1 << 30,
            "packed_num_buffers": 2,
            "use_load_plan": False,
            "metadata": None,
        }

    @property
    def nccl_update_optional(self) -> dict[str, object]:
        """NCCLWeightTransferUpdateInfo's optional fields: ncce:67-81@0.26.0; ncce:101-113@0.34.0."""
        if self._rl_router:
            return {"src": 0}
        return {"packed": False, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}

    @property
    def update_info_may_be_a_list(self) -> bool:
        """V-ROUTE-WT-UPDATE: a list indexed by global worker rank (gw:1718-1752@0.34.0)."""
        return self._rl_router

    @property
    def flags_incomplete_weight_update(self) -> bool:
        """V-REFIT-SESSION: `has_incomplete_weight_update` from start to a successful finish
        (gw:1652-1790@0.34.0)."""
        return self._rl_router

    @property
    def finish_takes_weight_version(self) -> bool:
        """V-ROUTE-WT-SESSION: /finish_weight_update {"weight_version"} from 0.27.0 (rlhf:205-211@0.27.0,
        alm:1455-1459@0.34.0)."""
        return self._rl_router

    @property
    def reload_clears_lora(self) -> bool:
        """V-REFIT-DISK: 0.34 also clears `model_weights` and `revision` and resets LoRA state
        (gw:645-663@0.34.0). Not observable without LoRA: kept for the record."""
        return self._rl_router

    @property
    def extra_metric_series(self) -> tuple[str, ...]:
        """V-METRIC-PROM: series 0.34 adds (…/entrypoints/serve/dev/sleep/metrics.py:21@0.34.0,
        …/entrypoints/rl/online/metrics.py:19@0.34.0, ml:538@0.34.0)."""
        if not self._rl_router:
            return ()
        return (
            "vllm:prompt_tokens_cached_by_source",
            "vllm:sleep_mode_operation_duration_seconds",
            "vllm:rl_weight_update_operation_duration_seconds",
        )
