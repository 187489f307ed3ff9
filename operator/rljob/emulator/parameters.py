"""What the emulated model's parameters hold, as SGLang's `/weights_checker` hashes them (C-CHECKER-CHECKSUM).

SGLang's model has the parameters its architecture defines; the emulator's has those its checkpoints and
pushes name, mapped as SGLang's loader maps them (for the architectures rljob.trainer.engines.sglang.digest
knows: qkv_proj and gate_up_proj fused from their parts, skipped tensors left out, the vocabulary padded; for
any other, each tensor is a parameter of its own name). A disk load replaces every parameter with the
checkpoint's (the emulator's model is its checkpoint); a push writes the parameters it names, a fused one part
by part. Each parameter keeps its parts' bytes (bytes or numpy arrays read from a file, a slice of the weights
region with the cuda backend) and is hashed with SGLang's function (rljob.trainer.engines.sglang.tensor_hash)
when first asked for. A release without CPU backup leaves every parameter garbage (C-MEM-RELEASE-ORDER): what
the resumed region holds with the cuda backend, zeros with the accounting one. A tensor the accounting backend
cannot read behind its IPC handle (no bytes shared with it: tensor_refit.py) holds bytes standing for the
handle's tensor at the refit's version, so equal pushes of one version hold equal weights.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.trainer.engines.sglang.digest import KNOWN_LAYOUTS, ModelLayout, checkpoint_layout, sglang_name
from rljob.trainer.engines.sglang.digest import _vocab_padding_rows as vocab_padding_rows
from rljob.trainer.engines.sglang.tensor_hash import hash_any, hex16

Part = Any  # bytes, a numpy array, a torch tensor or Unseen: the part's bytes in order


@dataclass(frozen=True)
class Unseen:
    """Bytes the emulator cannot see (behind an IPC handle it was given no memory for; an NCCL broadcast it
    does not run): they stand for the trainer's tensor of the version the refit loads, `key` naming the
    tensor. Bound to that version when the refit's version is known (`Parameters.bind`)."""

    key: bytes

    def at(self, version: str) -> bytes:
        return hashlib.sha256(self.key + b"@" + version.encode()).digest()


@dataclass(frozen=True)
class Loaded:
    """One tensor a load or push brings: its checkpoint name, shape and bytes."""

    name: str
    shape: tuple[int, ...]
    data: Part


def mapping(layout: ModelLayout) -> ModelLayout:
    """The layout the emulator maps names with: a known architecture's, else every tensor as it is."""
    return layout if layout.architecture in KNOWN_LAYOUTS else ModelLayout(None)


def _target(name: str, layout: ModelLayout) -> tuple[str, int, int] | None:
    if layout.architecture is None:
        return name, 0, 1
    if layout.tie_word_embeddings and name == "lm_head.weight":
        return None
    return sglang_name(name)


Naming = Any  # (checkpoint name, layout) -> (parameter, part index, part count) or None: skipped
Hashing = Any  # the parameter's parts' bytes, in order -> its hash as the engine's checker writes it


def _sglang_hash(parts: list[Part]) -> str:
    return hex16(hash_any(parts))


class Parameters:
    """`naming` and `hashing` are the engine's (SGLang's by default; vLLM's: emulator/vllm/worker.py)."""

    def __init__(self, naming: Naming = None, hashing: Hashing = None) -> None:
        self._naming = naming or _target
        self._hashing = hashing or _sglang_hash
        self._parts: dict[str, list[Part | None]] = {}
        self._rows: dict[str, tuple[int, ...]] = {}  # a padded-vocabulary parameter's first part's shape
        self._cache: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def replace(self, tensors: Iterable[Loaded], layout: ModelLayout) -> None:
        """A whole checkpoint: the model's parameters are its tensors, mapped."""
        self._parts, self._rows, self._cache = {}, {}, {}
        self.write(tensors, layout)

    def write(self, tensors: Iterable[Loaded], layout: ModelLayout) -> None:
        """Tensors loaded into the parameters they map to; a fused parameter's other parts stay."""
        layout = mapping(layout)
        for t in tensors:
            mapped = self._naming(t.name, layout)
            if mapped is None:
                continue
            target, index, count = mapped
            parts = self._parts.get(target)
            if parts is None or len(parts) != count:
                parts = self._parts[target] = [None] * count
            parts[index] = t.data
            if index == 0:
                self._rows[target] = t.shape
            self._cache.pop(target, None)

    def rename(self, store_as: Mapping[str, str], tensors: list[Loaded]) -> list[Loaded]:
        """Fault: a tensor named `a` stored under `b` (the loader's map is wrong)."""
        return [Loaded(store_as.get(t.name, t.name), t.shape, t.data) for t in tensors]

    def bind(self, version: str) -> None:
        """The refit's version is known: the bytes it could not see are the trainer's at that version."""
        for name, parts in self._parts.items():
            if any(isinstance(p, Unseen) for p in parts):
                self._parts[name] = [p.at(version) if isinstance(p, Unseen) else p for p in parts]
                self._cache.pop(name, None)

    def lose_contents(self) -> None:
        """A release without CPU backup: what a resume brings back is not what was there. A part in the
        weights region (the cuda backend) reads what the resumed memory holds; the accounting backend's
        resumed memory reads as zeros, on every pod alike (fresh pages; SGLang does not say)."""
        for name, parts in self._parts.items():
            self._parts[name] = [p if _in_region(p) else bytes(_nbytes(p)) for p in parts]
        self._cache = {}

    def zero(self) -> None:
        """Every parameter zeroed in place (its parts' sizes kept)."""
        self._parts = {n: [bytes(_nbytes(p)) for p in parts] for n, parts in self._parts.items()}
        self._cache = {}

    def copy_from(self, other: Parameters) -> None:
        self._parts = {k: list(v) for k, v in other._parts.items()}
        self._rows, self._cache = dict(other._rows), dict(other._cache)

    def hashes(self, version: str) -> dict[str, str]:
        """Every parameter's hash as /weights_checker writes it (bytes not seen yet bound to `version`)."""
        self.bind(version)
        for name, parts in self._parts.items():
            if name not in self._cache:
                self._cache[name] = self._hashing(self._bytes(name, parts))
        return dict(self._cache)

    def _bytes(self, name: str, parts: list[Part | None]) -> list[Part]:
        known = [p if p is not None else b"" for p in parts]  # a part never loaded: an empty stand-in
        shape = self._rows.get(name)
        if shape and known:
            pad = vocab_padding_rows(name, shape[0])
            if pad:
                row = _nbytes(known[0]) // max(1, shape[0])
                known.append(bytes(pad * row))  # fill_(0) of the padding rows
        return known


def _in_region(p: Part) -> bool:
    return type(p).__module__.startswith("torch")


def _nbytes(p: Part) -> int:
    if p is None or isinstance(p, Unseen):
        return 0
    if isinstance(p, bytes | bytearray | memoryview):
        return len(p)
    if hasattr(p, "nbytes"):
        return int(p.nbytes)
    return int(p.numel()) * int(p.element_size())


# --- checkpoints ---------------------------------------------------------------------------------------


def safetensors_tensors(blob: Any) -> list[Loaded]:
    """The tensors of one safetensors file's bytes (bytes, or a numpy uint8 array read back from a GPU)."""
    raw = memoryview(blob if not hasattr(blob, "tobytes") else blob.tobytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(bytes(raw[8 : 8 + length]))
    base = 8 + length
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        out.append(Loaded(name, tuple(meta["shape"]), bytes(raw[base + lo : base + hi])))
    return out


def checkpoint_of(path: str) -> ModelLayout:
    """The layout of the checkpoint at `path` (its config.json), or every tensor as it is."""
    return mapping(checkpoint_layout(Path(path)))
