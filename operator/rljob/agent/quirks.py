"""What the agent must do differently per SGLang version (contract §1)."""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST_SUPPORTED = (0, 5, 6)  # older releases take no body on /pause_generation (abort only)


def parse_version(version: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot parse SGLang version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@dataclass(frozen=True)
class SGLangQuirks:
    version: str
    key: tuple[int, int, int]

    @classmethod
    def detect(cls, version: str) -> SGLangQuirks:
        return cls(version, parse_version(version))

    @property
    def supported(self) -> bool:
        return self.key >= OLDEST_SUPPORTED

    @property
    def weight_version_route(self) -> str:
        """`/get_weight_version` only up to 0.5.6; a 404 (deprecated, then removed) afterwards."""
        return "/get_weight_version" if self.key < (0, 5, 15) else "/model_info"

    @property
    def load_route(self) -> str:
        """`/v1/loads` from 0.5.15; 0.5.6 only has the legacy `/get_load` list (no rates)."""
        return "/get_load" if self.key < (0, 5, 15) else "/v1/loads"

    @property
    def weight_update_session(self) -> bool:
        """Tensor/distributed refits must sit between begin/end_weight_update (PR #28001, 0.5.21)."""
        return self.key >= (0, 5, 21)

    @property
    def flush_takes_timeout(self) -> bool:
        """`/flush_cache?timeout=` defers the reply until idle (0.5.23); before, poll until 200."""
        return self.key >= (0, 5, 23)

    @property
    def refit_flush_kills_server(self) -> bool:
        """≤0.5.21 asserts when the post-refit flush is refused: only refit while paused and idle."""
        return self.key < (0, 5, 22)

    @property
    def has_weight_cache_flag(self) -> bool:
        return self.key >= (0, 5, 19)
