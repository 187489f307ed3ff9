"""The agent's pod-local record: what a restarted agent process needs to continue where it was.

The agent runs as a native sidecar (an init container with `restartPolicy: Always`), so the kubelet
restarts its process without ending the pod, and the engine keeps running beside it. The record lives on a
pod-scoped emptyDir (`medium: Memory`), so it survives the agent's restarts and dies with the pod, as the
engine's state does. It holds the agent's state report, the command in progress, and the *intent* of a
non-idempotent engine call: written (and fsynced) before the call, cleared together with the call's
outcome after it. An intent found on restart means the call may or may not have run; the agent then looks
for evidence (freed GPU memory, the served version) and, without any, reports StateUnknown instead of
guessing: a second release or resume of the same parts may kill the engine (docs/agent.md).

Each save is atomic: write a temporary file, fsync it, rename it over the record (a reader sees the old
record or the new one, never half of one). On tmpfs the fsync costs nothing; on a disk-backed emptyDir it
makes the record outlive a node crash, which the pod does not anyway, but it keeps the order of the
record and the call it announces the same on every filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORD_NAME = "agent-record.json"
FORMAT = 1


class RecordError(Exception):
    """The record exists but cannot be read: the agent cannot know what it did before its restart."""


@dataclass(frozen=True)
class Intent:
    """A non-idempotent engine call the agent is about to make (or is making)."""

    call: str  # release | resume | refit | refit_window
    epoch: int  # the command it belongs to
    tags: tuple[str, ...] = ()  # release / resume
    version: str | None = None  # refit: the version it loads
    path: str | None = None  # disk refit: the checkpoint
    used_before: dict[int, int] = field(default_factory=dict)  # per GPU, bytes, just before the call
    at: float = 0.0  # unix seconds
    named: str | None = None  # the call as the engine names it (Engine.call_name)

    def describe(self) -> str:
        args = ", ".join(self.tags) if self.tags else (self.version or "")
        return f"{self.named or self.call}({args}) at epoch {self.epoch}"

    def wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["tags"] = list(self.tags)
        out["used_before"] = {str(k): v for k, v in self.used_before.items()}
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Intent:
        return cls(
            call=str(data["call"]),
            epoch=int(data["epoch"]),
            tags=tuple(str(t) for t in data.get("tags") or ()),
            version=data.get("version"),
            path=data.get("path"),
            used_before={int(k): int(v) for k, v in (data.get("used_before") or {}).items()},
            at=float(data.get("at") or 0.0),
            named=data.get("named"),
        )


class AgentRecord:
    """One JSON file in the pod's state directory."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / RECORD_NAME
        self.saves = 0

    def load(self) -> dict[str, Any] | None:
        """The last saved record; None when there is none (the agent's first start in this pod)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RecordError(f"cannot read {self.path}: {e}") from e
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise RecordError(f"{self.path} is not JSON: {e}") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RecordError(f"{self.path}: unknown record format {data.get('format')!r}")
        return data

    def save(self, payload: dict[str, Any]) -> None:
        """Atomically replace the record (OSError when it cannot be written)."""
        data = json.dumps({"format": FORMAT, **payload}, separators=(",", ":")).encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{RECORD_NAME}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self.saves += 1

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
