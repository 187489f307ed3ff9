"""SGLang's launch facts, from `/server_info`: what its launch flags and version allow the handoff."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob.api.agent import LaunchRefusal, LaunchRefusalReason
from rljob.api.spec import EngineKind

GIB = 1 << 30  # SGLang's memory_usage figures are GB of 2^30 bytes (C-MEM-USAGE-REPORT)
USAGE_KEYS = {"weights": "weight", "kv_cache": "kvcache", "cuda_graph": "graph"}


@dataclass(frozen=True)
class SGLangFacts:
    """Launch facts from /server_info; they cannot change while the server runs (agent/engines/base.py
    EngineFacts)."""

    version: str
    weight_cache_mode: str
    memory_saver: bool
    weights_cpu_backup: bool
    dp_size: int
    dp_attention: bool = False
    tp_size: int = 1
    # Per GPU, the bytes of each memory tag as SGLang reports them (C-MEM-USAGE-REPORT); a tag it does not
    # report is absent. The headroom gate's split of one release between the resumes that follow it.
    tag_bytes: tuple[tuple[str, int], ...] = ()
    quantization: str | None = None  # --quantization: SGLang hashes dequantized weights (C-CHECKER-CHECKSUM)

    @property
    def kind(self) -> EngineKind:
        return EngineKind.SGLANG

    @property
    def reports_version(self) -> bool:
        """C-ROUTE-WV-READ: `/model_info` has `weight_version` on every version."""
        return True

    @property
    def weight_cache_active(self) -> bool:
        return self.weight_cache_mode != "off"

    @property
    def weights_survive_release(self) -> bool:
        """--enable-weights-cpu-backup: a resume of released weights copies them back from the host."""
        return self.weights_cpu_backup

    @property
    def keep_weights_hint(self) -> str:
        return "launch SGLang with --enable-weights-cpu-backup"

    @property
    def launch_refusal(self) -> LaunchRefusal | None:
        """C-MEM-WEIGHT-CACHE: under a CUDA-IPC weight cache a weight release or refit is fatal."""
        if not self.weight_cache_active:
            return None
        return LaunchRefusal(
            reason=LaunchRefusalReason.WEIGHT_CACHE_ACTIVE,
            message=f"SGLang runs with --weight-cache-mode {self.weight_cache_mode}: weight release and "
            "refit are fatal under a CUDA-IPC weight cache; restart SGLang with --weight-cache-mode off",
        )

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> SGLangFacts:
        return cls(
            version=str(info["version"]),
            weight_cache_mode=str(info.get("weight_cache_mode") or "off"),
            memory_saver=bool(info.get("enable_memory_saver", False)),
            weights_cpu_backup=bool(info.get("enable_weights_cpu_backup", False)),
            # C-DP-SERVER-INFO: dp_size and enable_dp_attention are /server_info keys on every version.
            dp_size=int(info.get("dp_size") or 1),
            dp_attention=bool(info.get("enable_dp_attention", False)),
            tp_size=int(info.get("tp_size") or 1),  # the decode roofline's bytes per GPU (docs/profiling.md)
            tag_bytes=tuple(sorted(reported_tag_bytes(info).items())),
            quantization=str(info["quantization"]) if info.get("quantization") else None,
        )


def reported_tag_bytes(info: dict[str, Any]) -> dict[str, int]:
    """Per GPU, the bytes of each memory tag from /server_info's `internal_states[*].memory_usage`
    (C-MEM-USAGE-REPORT: `weight`, `kvcache` and `graph` in GB, `graph` a number up to 0.5.15.post1 and
    per capture phase from 0.5.20); the largest over the DP ranks. A tag missing or unreadable on any
    rank is left out: the gate then takes the measured figure alone."""
    states = info.get("internal_states")
    if not isinstance(states, list) or not states:
        return {}
    usages = [s.get("memory_usage") if isinstance(s, dict) else None for s in states]
    out: dict[str, int] = {}
    for tag, key in USAGE_KEYS.items():
        values = [_gb(u.get(key)) if isinstance(u, dict) else None for u in usages]
        if all(v is not None for v in values):
            out[tag] = int(max(v for v in values if v is not None) * GIB)
    return out


def _gb(value: Any) -> float | None:
    if isinstance(value, dict):
        parts = [_gb(v) for v in value.values()]
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)
