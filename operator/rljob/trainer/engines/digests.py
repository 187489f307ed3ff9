"""The trainer's digest of the weights it publishes or pushes, as the agent takes it (api/agent.py
WeightsDigest): per engine parameter, the hash the engine's weights checksum will give once it loaded them.
Each engine's folder computes it its engine's way (trainer/engines/<name>/digest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Digest:
    """Per engine parameter name, its hash as the engine's checksum writes it; or why there is none."""

    parameters: dict[str, str] = field(default_factory=dict)
    unavailable: str | None = None
    seconds: float = 0.0  # time spent hashing (started on the GPU: starting it and waiting for it)

    def wire(self) -> dict[str, Any]:
        """The body field `digest` of the publish and of the refit window's close (api/agent.py)."""
        if self.unavailable is not None:
            return {"unavailable": self.unavailable[:1024]}
        return {"parameters": dict(self.parameters)}

    def merge(self, other: Digest) -> None:
        """Another push of the same window: its parameters added; unavailable if either is."""
        self.unavailable = self.unavailable or other.unavailable
        self.parameters.update(other.parameters)
        self.seconds += other.seconds
