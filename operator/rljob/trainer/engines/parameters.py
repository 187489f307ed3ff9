"""How an engine's loader makes its parameters of a checkpoint's tensors, as the digest needs it: which
tensors it fuses into one parameter (and in what order), which it drops, which it pads with zero rows; and
the model facts that decide whether its hashes can be had from whole tensors at all. The walk every engine's
digest shares; each engine's folder (trainer/engines/<name>/digest.py) gives its loader's names, with their
citations, and its own hash."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rljob.trainer.engines.digests import Digest

T = TypeVar("T")
Size = Callable[[T], tuple[tuple[int, ...], int]]  # a part's shape and its bytes


@dataclass(frozen=True)
class ModelLayout:
    """What the digest needs to know of the model: its architecture and whether lm_head is embed_tokens."""

    architecture: str | None
    tie_word_embeddings: bool = False
    quantization: str | None = None  # the checkpoint's quant_method, if any

    @classmethod
    def from_config(cls, config: Any) -> ModelLayout:
        """From a Hugging Face config object (`model.config`) or its dict (config.json)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        archs = get("architectures") or []
        quant = get("quantization_config")
        method = None
        if quant:
            method = str((quant.get("quant_method") if isinstance(quant, Mapping) else None) or "quantized")
        return cls(str(archs[0]) if archs else None, bool(get("tie_word_embeddings", False)), method)


@dataclass(frozen=True)
class LoaderNames:
    """One engine's loader, by the names it gives a checkpoint's tensors."""

    engine: str  # how messages name the engine
    stacked: tuple[tuple[str, tuple[str, ...]], ...]  # (fused name, its parts in order)
    dropped: tuple[str, ...]  # a tensor whose name holds one of these is no parameter
    padded_vocab: tuple[str, ...]  # parameters whose rows are padded with zeros
    vocab_padding: int  # to a multiple of this many rows
    known_layouts: frozenset[str]  # the architectures whose loader maps names as above
    quantized: str  # what the engine hashes of a quantized checkpoint

    def unavailable(self, layout: ModelLayout) -> str | None:
        """Why the engine's hashes cannot be computed from this model's tensors, or None."""
        if layout.quantization is not None:
            return (
                f"the checkpoint is quantized ({layout.quantization}): {self.engine} {self.quantized}, "
                "which the SDK does not reproduce"
            )
        if layout.architecture is None:
            return "the model's architecture is not known (no `architectures` in its config)"
        if layout.architecture not in self.known_layouts:
            known = ", ".join(sorted(self.known_layouts))
            return (
                f"{self.engine}'s parameter layout of {layout.architecture} (how its loader fuses the "
                f"checkpoint's tensors) is not known to the SDK; known: {known}"
            )
        return None

    def target(self, name: str) -> tuple[str, int, int] | None:
        """The parameter a checkpoint tensor loads into, its place among the parameter's parts and their
        count; None for tensors the loader drops."""
        if any(d in name for d in self.dropped):
            return None
        for fused, parts in self.stacked:
            for i, part in enumerate(parts):
                if part in name:
                    return name.replace(part, fused), i, len(parts)
        return name, 0, 1

    def plan(self, names: Iterable[str], layout: ModelLayout) -> tuple[dict[str, list[str]], list[str]]:
        """Parameter -> the checkpoint tensors it is made of, in order, for the parameters whose every part
        is among `names`; and the parameters left out because only some of their parts are."""
        parts: dict[str, dict[int, str]] = {}
        counts: dict[str, int] = {}
        for name in names:
            if layout.tie_word_embeddings and name == "lm_head.weight":
                continue
            mapped = self.target(name)
            if mapped is None:
                continue
            target, index, count = mapped
            parts.setdefault(target, {})[index] = name
            counts[target] = count
        whole = {t: [p[i] for i in range(counts[t])] for t, p in parts.items() if len(p) == counts[t]}
        partial = sorted(t for t, p in parts.items() if len(p) != counts[t])
        return whole, partial

    def padding_rows(self, name: str, rows: int) -> int:
        return (-rows % self.vocab_padding) if name in self.padded_vocab else 0

    def parameters(
        self, tensors: Mapping[str, T], layout: ModelLayout, size: Size[T]
    ) -> Iterator[tuple[str, list[T], int]]:
        """Each parameter whose every part is in `tensors`: its name, its parts in order, and how many zero
        bytes of vocabulary padding follow them (the first part's rows padded, each of its row's size)."""
        whole, _partial = self.plan(tensors, layout)
        for target, names in whole.items():
            parts = [tensors[n] for n in names]
            shape, nbytes = size(parts[0])
            rows = int(shape[0]) if len(shape) >= 1 else 0
            pad = self.padding_rows(target, rows) if rows else 0
            yield target, parts, pad * (nbytes // rows) if pad else 0

    def digest(
        self,
        named: Iterable[tuple[str, T]],
        layout: ModelLayout,
        size: Size[T],
        hash_parameter: Callable[[list[T], int], str],
    ) -> Digest:
        """Each parameter's hash of its parts and its padding's zero bytes (`hash_parameter`), timed; or why
        there is none (`named` is not read then)."""
        started = time.perf_counter()
        why = self.unavailable(layout)
        if why is not None:
            return Digest(unavailable=why)
        tensors = dict(named)
        out = {t: hash_parameter(parts, zero) for t, parts, zero in self.parameters(tensors, layout, size)}
        return Digest(out, seconds=time.perf_counter() - started)

    def checkpoint_digest(
        self,
        path: str | Path,
        layout: ModelLayout | None,
        hash_parameter: Callable[[list[Stored], int], str],
    ) -> Digest:
        """`digest` of the safetensors checkpoint at `path`; `layout` defaults to its config.json."""
        started = time.perf_counter()
        path = Path(path)
        layout = layout or checkpoint_layout(path)
        why = self.unavailable(layout)
        if why is not None:
            return Digest(unavailable=why)
        parameters = self.parameters(read_index(path), layout, Stored.size)
        out = {t: hash_parameter(parts, zero) for t, parts, zero in parameters}
        return Digest(out, seconds=time.perf_counter() - started)


# --- checkpoints on disk ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """Where a tensor's bytes are in a safetensors file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    end: int

    def size(self) -> tuple[tuple[int, ...], int]:
        return self.shape, self.end - self.start

    def read(self) -> bytes:
        with self.file.open("rb") as fh:
            fh.seek(self.start)
            return fh.read(self.end - self.start)


def read_index(path: Path) -> dict[str, Stored]:
    """Every tensor of the safetensors files at `path` (a file, or a directory of *.safetensors): where its
    bytes are. The header is read by hand (8-byte little-endian length, then JSON)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors file at {path}")
    index: dict[str, Stored] = {}
    for f in files:
        with f.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        base = 8 + length
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            index[name] = Stored(f, str(meta["dtype"]), tuple(meta["shape"]), base + lo, base + hi)
    return index


def checkpoint_layout(path: Path) -> ModelLayout:
    """From the checkpoint's config.json (beside the file, or in the directory)."""
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return ModelLayout(None)
    return ModelLayout.from_config(json.loads(config.read_text()))
