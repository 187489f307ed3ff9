"""The weights the emulated server holds: where they came from, their checksum (evidence that a refit
landed) and whether their contents are valid (resume without CPU backup brings back garbage)."""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.emulator.parameters import Loaded, safetensors_tensors


class WeightsLoadError(Exception):
    pass


@dataclass
class LoadedWeights:
    source: str  # "launch" | "disk" | "tensor" | "distributed"
    path: str
    checksum: str  # sha256 hex of what was loaded
    valid: bool = True
    tensors: int = 0

    @property
    def id(self) -> str:
        """What decoding depends on: the checksum, or noise for lost contents."""
        return self.checksum if self.valid else "garbage"

    def lose_contents(self) -> None:
        self.valid = False
        self.checksum = "garbage-" + secrets.token_hex(8)


def safetensors_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(p.glob("*.safetensors"))
    return []


# Where loaded checkpoint bytes go besides the checksum. None (the accounting backend): nowhere. The cuda
# backend registers one that copies the files into its weights region and returns what the device then
# holds, so the checksum the emulator serves is computed over GPU memory read back.
WeightsSink = Callable[[list[bytes]], Iterable[Any]]
_sink: WeightsSink | None = None


def set_weights_sink(sink: WeightsSink | None) -> None:
    global _sink
    _sink = sink


def _count_tensors(f: Path, data: bytes) -> int:
    """The header is parsed by hand (8-byte little-endian length, then JSON) to prove it is one."""
    if len(data) < 8:
        raise WeightsLoadError(f"{f}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + header_len])
    except ValueError as e:
        raise WeightsLoadError(f"{f}: bad safetensors header: {e}") from e
    return sum(1 for k in header if k != "__metadata__")


@dataclass(frozen=True)
class Checkpoint:
    checksum: str  # sha256 over the files' bytes as loaded
    tensors: list[Loaded]  # each tensor's bytes as loaded (the parameters' contents: parameters.py)


def read_checkpoint(path: str) -> Checkpoint:
    """Every safetensors file at `path` (a file or a directory): sha256 over their bytes, and their
    tensors. With a weights sink both come from the bytes the sink read back after loading them."""
    files = safetensors_files(path)
    if not files:
        raise WeightsLoadError(f"no safetensors file at {path}")
    digest, tensors = hashlib.sha256(), []
    blobs = [f.read_bytes() for f in files]
    for f, b in zip(files, blobs, strict=True):  # all valid before loading
        _count_tensors(f, b)
    for chunk in blobs if _sink is None else _sink(blobs):
        digest.update(chunk)
        tensors += safetensors_tensors(chunk)
    return Checkpoint(digest.hexdigest(), tensors)


def read_safetensors(path: str) -> tuple[str, int]:
    """sha256 over the bytes of every safetensors file at `path` and the tensor count (read_checkpoint)."""
    cp = read_checkpoint(path)
    return cp.checksum, len(cp.tensors)


def launch_weights(model_path: str) -> tuple[LoadedWeights, list[Loaded]]:
    """At launch a real checkpoint is read when `--model-path` points at one; else the name stands in (and
    the model has no parameters)."""
    try:
        cp = read_checkpoint(model_path)
    except (WeightsLoadError, OSError):
        return LoadedWeights("launch", model_path, hashlib.sha256(model_path.encode()).hexdigest()), []
    return LoadedWeights("launch", model_path, cp.checksum, tensors=len(cp.tensors)), cp.tensors
