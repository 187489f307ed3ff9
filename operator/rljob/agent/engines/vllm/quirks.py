"""What the agent must do differently per vLLM version. Only the versions whose wheels were read
(docs/vllm-conformance.md) are driven: any other is refused for good, naming them. Each property names its
row and the wheel source it was read from (`path:line@version`, `…/` = `vllm/`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = ("0.26.0", "0.34.0")


def parse_version(version: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot parse vLLM version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@dataclass(frozen=True)
class VLLMQuirks:
    version: str

    @classmethod
    def detect(cls, version: str) -> VLLMQuirks:
        parse_version(version)
        return cls(version)

    @property
    def is_supported(self) -> bool:
        """Only the recorded versions: nothing between 0.27.0 and 0.34.0 was read, and a route that moved
        or a reply that changed shape would be misread."""
        return self.version in SUPPORTED

    @property
    def _rl_router(self) -> bool:
        """0.34 serves the pause and weight routes from …/entrypoints/rl/online/api_router.py."""
        return parse_version(self.version) >= (0, 34, 0)

    @property
    def carries_weight_version(self) -> bool:
        """V-ROUTE-WV: `/weight_info` and `/update_weight_version` exist from 0.27.0 (rlhf:214-226@0.27.0);
        0.26 carries no weight version: the agent labels the weights itself."""
        return self._rl_router

    @property
    def finish_takes_weight_version(self) -> bool:
        """V-ROUTE-WT-SESSION: `/finish_weight_update {"weight_version"}` from 0.27.0
        (rlhf:205-211@0.27.0, alm:1455-1459@0.34.0)."""
        return self._rl_router

    @property
    def checksums_weights(self) -> bool:
        """V-ROUTE-CHECKER: `POST /weight_checker {"action": "checksum"}` (rl:232-266@0.34.0); 0.26 has no
        route that reads weights back."""
        return self._rl_router

    @property
    def releases_kv_alone(self) -> bool:
        """V-MEM-RELEASE-KV: `/release_kv_cache_memory` (sleep:38-45@0.34.0); 0.26's `/sleep` takes weights
        and KV together."""
        return self._rl_router

    @property
    def packed_in_init_info(self) -> bool:
        """V-REFIT-IPC: `packed` is an IPC init field in 0.34 (ipc:36-44@0.34.0), an update field in 0.26
        (ipc:72-132@0.26.0); 0.34 refuses it in an update_info (V-KILL-REFIT-FAILED)."""
        return self._rl_router

    @property
    def paused_requests_refused(self) -> bool:
        """V-REQ-PAUSED: after `/pause?mode=abort|wait` 0.34 answers new requests 503 until a resume
        (core:2002-2023,2456-2469@0.34.0): the generation probe goes out after the resume. 0.26 queues them
        (alm:280-415@0.26.0)."""
        return self._rl_router

    @property
    def sleep_skips_while_any_part_sleeps(self) -> bool:
        """V-MEM-SLEEP-TWICE: 0.26's executor skips a sleep while any tag sleeps (exe:318-321@0.26.0); 0.34
        only while `weights` sleeps (exe:437-440@0.34.0). Either way a second sleep frees nothing it should
        (silent): the agent never sends one while anything sleeps."""
        return not self._rl_router

    @property
    def wake_says_awake(self) -> bool:
        """V-ROUTE-WAKE: 0.34 answers `{"status": "awake"|"sleeping", "tags"}` (sleep:48-59@0.34.0); 0.26
        an empty 200 (sleep:32-42@0.26.0)."""
        return self._rl_router

    @property
    def flush_ands_ranks(self) -> bool:
        """V-DP-FANOUT: 0.34 ANDs `/reset_prefix_cache`'s `success` over the DP ranks (cc:1416-1423
        @0.34.0); 0.26 returns DP rank 0's (cc:1449-1457@0.26.0)."""
        return self._rl_router
