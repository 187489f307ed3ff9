"""What changed between the emulated SGLang versions (contract §1). One profile per version string."""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_VERSIONS = ("0.5.6", "0.5.15.post1", "0.5.21", "0.5.23")
DEFAULT_VERSION = "0.5.23"


def version_key(version: str) -> tuple[int, int, int]:
    """`0.5.15.post1` -> (0, 5, 15); post/rc suffixes do not change behaviour here."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not an SGLang version: {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@dataclass(frozen=True)
class VersionProfile:
    version: str

    @property
    def key(self) -> tuple[int, int, int]:
        return version_key(self.version)

    def _at_least(self, patch: int) -> bool:
        return self.key >= (0, 5, patch)

    @property
    def get_weight_version(self) -> str:
        """`/get_weight_version`: "ok" (≤0.5.6), "deprecated" (404 with a hint), "removed" (plain 404)."""
        if not self._at_least(15):
            return "ok"
        return "deprecated" if not self._at_least(21) else "removed"

    @property
    def get_load(self) -> str:
        """`/get_load`: "list" (0.5.6), "shim" over /v1/loads (0.5.15 to 0.5.20), "removed" (≥0.5.21)."""
        if not self._at_least(15):
            return "list"
        return "shim" if not self._at_least(21) else "removed"

    @property
    def has_v1_loads(self) -> bool:  # inferred for 0.5.6: the legacy shim appeared with it
        return self._at_least(15)

    @property
    def has_ready(self) -> bool:
        return self._at_least(20)

    @property
    def has_admin_api_key(self) -> bool:
        return self._at_least(15)

    @property
    def needs_weight_update_session(self) -> bool:
        return self._at_least(21)

    @property
    def refit_flush_failure_is_fatal(self) -> bool:
        """≤0.5.21 asserts "Cache flush failed after updating weights"; 0.5.23 returns success:false."""
        return not self._at_least(22)

    @property
    def has_weight_versions_spans(self) -> bool:
        return self._at_least(19)

    @property
    def has_weight_cache(self) -> bool:
        return self._at_least(19)

    @property
    def flush_cache_takes_timeout(self) -> bool:
        return self._at_least(23)

    @property
    def has_moe_ep_rank_label(self) -> bool:
        return self._at_least(7)

    @property
    def has_weight_load_duration_metric(self) -> bool:
        return self._at_least(15)

    @property
    def idle_assert_text(self) -> str:
        if not self._at_least(15):
            return "release_memory_occupation should be called only when no ongoing request."
        return "release_memory_occupation should be called only when server is idle."
