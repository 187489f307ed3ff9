"""The trainer's digest of the weights it publishes or pushes: per SGLang parameter, the 16-hex hash
SGLang's `/weights_checker` (action `checksum`) gives for it once the weights are loaded, computed from the
trainer's own tensors or checkpoint (tensor_hash.py). The agent holds SGLang's answer against it after the
refit (docs/agent.md, "Verified weights").

SGLang hashes its own parameters, not the checkpoint's tensors. For the architectures whose loader was read
(`KNOWN_LAYOUTS`), the digest maps a checkpoint's names to them the way the loader does
(…/models/llama.py:628-700@0.5.15.post1, `load_weights`):

- q_proj, k_proj and v_proj are one `qkv_proj` (rows q, then k, then v), gate_proj and up_proj one
  `gate_up_proj` (gate, then up): `stacked_params_mapping`; with TP 1 the fused parameter's bytes are its
  parts' bytes back to back, which is what hashing the parts' concatenation gives;
- `rotary_emb.inv_freq`, `rotary_emb.cos_cached` / `sin_cached` and `projector` tensors are skipped, and so
  is `lm_head.weight` when the embeddings are tied (SGLang's lm_head is then embed_tokens);
- the vocabulary rows of `embed_tokens` and `lm_head` are padded to a multiple of 64 with zeros
  (…/layers/vocab_parallel_embedding.py:45,499@0.5.15.post1, `DEFAULT_VOCAB_PADDING_SIZE`, `fill_(0)`).

Where the SGLang side cannot be reproduced from whole tensors, the digest is `unavailable` with the reason:
an architecture whose loader was not read, a quantized checkpoint (SGLang hashes the dequantized weight).
TP shards are the agent's to refuse (it knows SGLang's tp_size). The bytes are hashed as the trainer holds
them: SGLang stores a tensor in the dtype it runs (`--dtype`), so a trainer that pushes another dtype gets a
mismatch on every such parameter.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.trainer.engines.digests import Digest as Digest  # re-exported: the SDK's digest type
from rljob.trainer.engines.sglang import tensor_hash

VOCAB_PADDING = 64  # …/layers/vocab_parallel_embedding.py:45@0.5.15.post1
STACKED = (  # (SGLang's fused name, its parts in order): stacked_params_mapping, llama.py:629-636
    (".qkv_proj", (".q_proj", ".k_proj", ".v_proj")),
    (".gate_up_proj", (".gate_proj", ".up_proj")),
)
SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "projector")
PADDED_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# Architectures whose SGLang loader maps names as above: Llama's load_weights, and Mistral's, which
# renames Mistral-format names to Llama's and calls it (…/models/mistral.py:59-60@0.5.15.post1).
KNOWN_LAYOUTS = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


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

    def unavailable(self) -> str | None:
        """Why SGLang's hashes cannot be computed from this model's tensors, or None."""
        if self.quantization is not None:
            return (
                f"the checkpoint is quantized ({self.quantization}): SGLang hashes its dequantized weights, "
                "which the SDK does not reproduce"
            )
        if self.architecture is None:
            return "the model's architecture is not known (no `architectures` in its config)"
        if self.architecture not in KNOWN_LAYOUTS:
            return (
                f"SGLang's parameter layout of {self.architecture} (how its loader fuses the checkpoint's "
                f"tensors) is not known to the SDK; known: {', '.join(sorted(KNOWN_LAYOUTS))}"
            )
        return None


def sglang_name(name: str) -> tuple[str, int, int] | None:
    """The SGLang parameter a checkpoint tensor loads into, its place among the parameter's parts and their
    count; None for tensors the loader skips."""
    if any(s in name for s in SKIPPED):
        return None
    for fused, parts in STACKED:
        for i, part in enumerate(parts):
            if part in name:
                return name.replace(part, fused), i, len(parts)
    return name, 0, 1


def plan(names: Iterable[str], layout: ModelLayout) -> tuple[dict[str, list[str]], list[str]]:
    """SGLang parameter -> the checkpoint tensors it is made of, in order, for the parameters whose every
    part is among `names`; and the parameters left out because only some of their parts are."""
    parts: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for name in names:
        if layout.tie_word_embeddings and name == "lm_head.weight":
            continue
        mapped = sglang_name(name)
        if mapped is None:
            continue
        target, index, count = mapped
        parts.setdefault(target, {})[index] = name
        counts[target] = count
    whole = {t: [p[i] for i in range(counts[t])] for t, p in parts.items() if len(p) == counts[t]}
    partial = sorted(t for t, p in parts.items() if len(p) != counts[t])
    return whole, partial


def _vocab_padding_rows(name: str, rows: int) -> int:
    return (-rows % VOCAB_PADDING) if name in PADDED_VOCAB else 0


def digest_named_tensors(named: Iterable[tuple[str, Any]], layout: ModelLayout) -> Digest:
    """The digest of torch tensors (on any device: hashed there) or numpy arrays, by checkpoint name."""
    pending = start_digest_named_tensors(named, layout)
    pending.release()
    return pending.result()


@dataclass
class PendingDigest:
    """A digest whose hashes may still run on the GPU (tensor_hash.start_hashes): `release()` once the
    tensors may change, `result()` to wait for it."""

    targets: list[str]
    hashes: tensor_hash.PendingHashes | None
    unavailable: str | None = None
    seconds: float = 0.0  # spent starting it

    def release(self) -> None:
        if self.hashes is not None:
            self.hashes.release()

    def result(self) -> Digest:
        """The digest; `seconds`: starting it and waiting for it here."""
        if self.unavailable is not None or self.hashes is None:
            return Digest(unavailable=self.unavailable, seconds=self.seconds)
        waited = time.perf_counter()
        values = self.hashes.result()
        seconds = self.seconds + time.perf_counter() - waited
        return Digest(dict(zip(self.targets, map(tensor_hash.hex16, values), strict=True)), seconds=seconds)


def start_digest_named_tensors(named: Iterable[tuple[str, Any]], layout: ModelLayout) -> PendingDigest:
    """`digest_named_tensors` begun: CUDA tensors are hashed on a side stream after the work queued on the
    current stream (tensor_hash.start_hashes), the rest here; nothing is waited for."""
    started = time.perf_counter()
    why = layout.unavailable()
    if why is not None:
        return PendingDigest([], None, unavailable=why)
    tensors = dict(named)
    whole, _partial = plan(tensors, layout)
    groups: list[tensor_hash.Group] = []
    for target, names in whole.items():
        items = [tensors[n] for n in names]
        first = items[0]
        pad = _vocab_padding_rows(target, int(first.shape[0])) if first.ndim >= 1 else 0
        zero = pad * (int(first.nbytes) // int(first.shape[0])) if pad else 0
        groups.append((items, zero))
    hashes = tensor_hash.start_hashes(groups)
    return PendingDigest(list(whole), hashes, seconds=time.perf_counter() - started)


# --- checkpoints on disk ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets in the file
    end: int


def read_index(path: Path) -> dict[str, _Stored]:
    """Every tensor of the safetensors files at `path` (a file, or a directory of *.safetensors): where its
    bytes are. The header is read by hand (8-byte little-endian length, then JSON)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors file at {path}")
    index: dict[str, _Stored] = {}
    for f in files:
        with f.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        base = 8 + length
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            index[name] = _Stored(f, str(meta["dtype"]), tuple(meta["shape"]), base + lo, base + hi)
    return index


def checkpoint_layout(path: Path) -> ModelLayout:
    """From the checkpoint's config.json (beside the file, or in the directory)."""
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return ModelLayout(None)
    return ModelLayout.from_config(json.loads(config.read_text()))


def checkpoint_digest(
    path: str | Path, *, device: str | None = None, layout: ModelLayout | None = None
) -> Digest:
    """The digest of a safetensors checkpoint as SGLang will hold it once `update_weights_from_disk` loaded
    it: on the CPU with numpy, or with torch on `device` (e.g. "cuda": the files' bytes are copied there
    and hashed at the GPU's speed). `layout` defaults to the checkpoint's config.json."""
    started = time.perf_counter()
    path = Path(path)
    layout = layout or checkpoint_layout(path)
    why = layout.unavailable()
    if why is not None:
        return Digest(unavailable=why)
    index = read_index(path)
    whole, _partial = plan(index, layout)
    out: dict[str, str] = {}
    maps: dict[Path, Any] = {}
    for target, names in whole.items():
        stored = [index[n] for n in names]
        chunks = [_file_bytes(maps, s) for s in stored]
        first = stored[0]
        pad = _vocab_padding_rows(target, first.shape[0]) if first.shape else 0
        if pad:
            row = (first.end - first.start) // max(1, first.shape[0])
            chunks.append(bytes(pad * row))
        out[target] = tensor_hash.hex16(_hash_chunks(chunks, device))
    return Digest(out, seconds=time.perf_counter() - started)


def _file_bytes(maps: dict[Path, Any], s: _Stored) -> Any:
    import numpy as np

    m = maps.get(s.file)
    if m is None:
        m = maps[s.file] = np.memmap(s.file, dtype=np.uint8, mode="r")
    return m[s.start : s.end]


def _hash_chunks(chunks: list[Any], device: str | None) -> int:
    if device is None:
        return tensor_hash.hash_bytes(*chunks)
    import numpy as np
    import torch

    parts = [torch.from_numpy(np.array(c, dtype=np.uint8, copy=True)).to(device) for c in chunks]
    return tensor_hash.hash_tensors(parts)
