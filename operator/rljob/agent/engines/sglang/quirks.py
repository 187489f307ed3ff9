"""What the agent must do differently per SGLang version. Each property names its row of
docs/sglang-conformance.md and the wheel source it was read from (`path:line@version`, paths relative to
the wheel's `sglang/srt/`). Versions between two checked ones take the safer side, said per property."""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST_SUPPORTED = (0, 5, 6)  # older releases take no body on /pause_generation (abort only)


def parse_version(version: str) -> tuple[int, int, int]:
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot parse SGLang version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def parse_post(version: str) -> int:
    """`0.5.6.post2` -> 2; 0 without a post suffix."""
    m = re.search(r"\.post(\d+)", version)
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class SGLangQuirks:
    version: str
    key: tuple[int, int, int]
    post: int = 0

    @classmethod
    def detect(cls, version: str) -> SGLangQuirks:
        return cls(version, parse_version(version), parse_post(version))

    @property
    def is_supported(self) -> bool:
        return self.key >= OLDEST_SUPPORTED

    @property
    def load_route(self) -> str:
        """C-METRIC-LOAD-ROUTE: `/v1/loads` (one entry per DP rank) from 0.5.8; before, only `/get_load`, a
        list per DP rank of counts. `/get_load` is removed in 0.5.21."""
        return "/get_load" if self.key < (0, 5, 8) else "/v1/loads"

    @property
    def has_get_load_shim(self) -> bool:
        """C-METRIC-LOAD-ASGI: up to 0.5.20 `/get_load` still answers (from 0.5.15 a shim over the load
        snapshots `/v1/loads` reads); removed in 0.5.21. The agent falls back to it when `/v1/loads` answers
        500, as 0.5.15.post1 does with --enable-metrics under FastAPI >= 0.137."""
        return (0, 5, 8) <= self.key < (0, 5, 21)

    @property
    def weight_update_session(self) -> bool:
        """C-ROUTE-SESSION: tensor/distributed refits sit between /begin_weight_update and
        /end_weight_update from 0.5.21."""
        return self.key >= (0, 5, 21)

    @property
    def flush_takes_timeout(self) -> bool:
        """C-ROUTE-FLUSH: `/flush_cache?timeout=` defers the reply until idle from 0.5.10. Its idle check
        always counts waiting requests (C-IDLE-FLUSH-DEFERRED), so the agent sends it only after an abort
        drain."""
        return self.key >= (0, 5, 10)

    @property
    def release_ignores_waiting_when_retracted(self) -> bool:
        """C-IDLE-FLUSH / C-IDLE-RELEASE: the plain flush and the release assert ignore the waiting queue
        that a retract fills: always up to 0.5.8 (`_is_no_request`), while paused from 0.5.21
        (`is_fully_idle(ignore_waiting=_engine_paused)`). From 0.5.10 to 0.5.20 waiting always counts: a
        retract drain with requests in flight never becomes idle there. 0.5.9 was not read: treated as
        strict."""
        return self.key < (0, 5, 9) or self.key >= (0, 5, 21)

    @property
    def refit_while_paused_records_version(self) -> bool:
        """C-REFIT-WV-PAUSED: 0.5.6 returns from a disk/tensor/distributed refit while paused before
        `_update_weight_version_if_provided`; fixed in 0.5.6.post2. Without it the agent sets the version
        with `/update_weight_version` (C-ROUTE-WV-SET)."""
        return self.key > (0, 5, 6) or (self.key == (0, 5, 6) and self.post >= 2)

    @property
    def subprocess_watchdog(self) -> bool:
        """C-DEATH-HARD: from 0.5.10 a SubprocessWatchdog kills the server soon after a scheduler exit, so
        a refused connection is death. Before (0.5.6, 0.5.8 checked) a scheduler that dies hard leaves HTTP
        up and `/ping` 200 (C-HEALTH-PING): the agent needs a bounded scheduler probe."""
        return self.key >= (0, 5, 10)

    @property
    def unknown_weights_group_is_fatal(self) -> bool:
        """C-REFIT-GROUP-UNKNOWN: up to 0.5.20 a distributed push naming a group SGLang never formed trips
        an assert outside any try and kills the server; from 0.5.21 it answers 400."""
        return self.key < (0, 5, 21)

    @property
    def loads_frozen_while_paused(self) -> bool:
        """C-DP-LOADS-PAUSED: the load route reads snapshots the schedulers publish from their loop, and a
        paused (retract / in_place) scheduler skips the publish: its counts stay at their pre-pause values.
        0.5.8 still asked the schedulers, and so do both load routes of 0.5.10.post1; 0.5.11 to 0.5.14
        were not read: treated as frozen."""
        return self.key >= (0, 5, 11)

    @property
    def checker_checksum(self) -> bool:
        """C-ROUTE-CHECKER / C-CHECKER-CHECKSUM: `/weights_checker` answers action `checksum` (a hash per
        parameter and per GPU) from 0.5.15.post1 (utils/weight_checker.py:81-82,120-157@0.5.15.post1); 0.5.6
        and 0.5.10.post1 know only snapshot, reset_tensors and compare, and answer 400 "Unsupported
        action='checksum'" (utils/weight_checker.py:19-28@0.5.6). 0.5.11 to 0.5.14 were not read: treated as
        without it."""
        return self.key >= (0, 5, 15)
