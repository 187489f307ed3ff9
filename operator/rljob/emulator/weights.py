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


def read_safetensors(path: str) -> tuple[str, int]:
    """sha256 over the bytes of every safetensors file at `path` (a file or a directory) and the tensor
    count. With a weights sink the bytes hashed are those the sink read back after loading them."""
    files = safetensors_files(path)
    if not files:
        raise WeightsLoadError(f"no safetensors file at {path}")
    digest, tensors = hashlib.sha256(), 0
    if _sink is None:
        for f in files:
            data = f.read_bytes()
            tensors += _count_tensors(f, data)
            digest.update(data)
        return digest.hexdigest(), tensors
    blobs = [f.read_bytes() for f in files]
    tensors = sum(_count_tensors(f, b) for f, b in zip(files, blobs, strict=True))  # all valid before loading
    for chunk in _sink(blobs):
        digest.update(chunk)
    return digest.hexdigest(), tensors


def launch_weights(model_path: str) -> LoadedWeights:
    """At launch a real checkpoint is read when `--model-path` points at one; else the name stands in."""
    try:
        checksum, tensors = read_safetensors(model_path)
    except (WeightsLoadError, OSError):
        checksum, tensors = hashlib.sha256(model_path.encode()).hexdigest(), 0
    return LoadedWeights("launch", model_path, checksum, tensors=tensors)
