"""The trainer's digest of the weights it publishes or pushes, as vLLM 0.34's `/weight_checker` will hash
them (V-CHECKER-HASH in docs/vllm-conformance.md): per vLLM parameter, sha256 of its raw bytes
(`weight.detach().cpu().contiguous().view(-1).view(torch.uint8)`,
…/model_executor/model_loader/weight_checksum.py:15-43@0.34.0), 64 hex digits. Reproducible from the
trainer's own tensors or checkpoint: no kernel of vLLM's is involved, only the bytes and vLLM's names.

vLLM hashes its own parameters (`named_parameters()`, no buffers), not the checkpoint's tensors. For the
architectures whose loader was read (`KNOWN_LAYOUTS`), the digest maps a checkpoint's names to vLLM's
(…/model_executor/models/llama.py:348-357@0.34.0, `hf_to_vllm_mapper`; the same at :348-356@0.26.0):

- q_proj, k_proj and v_proj are one `qkv_proj` (shards q, k, v in that order), gate_proj and up_proj one
  `gate_up_proj`; with TP 1 the fused parameter's bytes are its parts' bytes back to back;
- `rotary_emb.inv_freq`, `rotary_emb.cos_cached` and `sin_cached` are dropped
  (…/model_executor/models/utils.py:246-254@0.34.0), and `lm_head.weight` is not a parameter of its own when
  the embeddings are tied (llama.py:509-510@0.34.0: named_parameters() yields a shared one once);
- the vocabulary rows of `embed_tokens` and `lm_head` are padded to a multiple of 64 with zeros
  (…/model_executor/layers/vocab_parallel_embedding.py:39,525@0.34.0, `fill_(0)`).

Where vLLM's bytes cannot be had from whole tensors the digest is `unavailable` with the reason: another
architecture, a quantized checkpoint. TP shards are the agent's to leave out (it knows vLLM's TP size). The
bytes are hashed as the trainer holds them: a tensor in another dtype than vLLM runs is a mismatch."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.trainer.engines.digests import Digest

VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE, vocab_parallel_embedding.py:39@0.34.0
STACKED = (  # (vLLM's fused name, its parts in order): hf_to_vllm_mapper, llama.py:348-357@0.34.0
    (".qkv_proj", (".q_proj", ".k_proj", ".v_proj")),
    (".gate_up_proj", (".gate_proj", ".up_proj")),
)
DROPPED = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
PADDED_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# Architectures vLLM loads through Llama's mapper (…/model_executor/models/registry.py:155,179@0.34.0;
# MistralForCausalLM subclasses LlamaForCausalLM).
KNOWN_LAYOUTS = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


@dataclass(frozen=True)
class ModelLayout:
    """What the digest needs to know of the model: its architecture and whether lm_head is embed_tokens."""

    architecture: str | None
    tie_word_embeddings: bool = False
    quantization: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelLayout:
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        archs = get("architectures") or []
        quant = get("quantization_config")
        method = None
        if quant:
            method = str((quant.get("quant_method") if isinstance(quant, Mapping) else None) or "quantized")
        return cls(str(archs[0]) if archs else None, bool(get("tie_word_embeddings", False)), method)

    def unavailable(self) -> str | None:
        if self.quantization is not None:
            return (
                f"the checkpoint is quantized ({self.quantization}): vLLM hashes the quantized parameters "
                "it builds, which the SDK does not reproduce"
            )
        if self.architecture is None:
            return "the model's architecture is not known (no `architectures` in its config)"
        if self.architecture not in KNOWN_LAYOUTS:
            return (
                f"vLLM's parameter layout of {self.architecture} (how its loader fuses the checkpoint's "
                f"tensors) is not known to the SDK; known: {', '.join(sorted(KNOWN_LAYOUTS))}"
            )
        return None


def vllm_name(name: str) -> tuple[str, int, int] | None:
    """The vLLM parameter a checkpoint tensor loads into, its place among the parameter's parts and their
    count; None for tensors the loader drops."""
    if any(d in name for d in DROPPED):
        return None
    for fused, parts in STACKED:
        for i, part in enumerate(parts):
            if part in name:
                return name.replace(part, fused), i, len(parts)
    return name, 0, 1


def plan(names: Iterable[str], layout: ModelLayout) -> tuple[dict[str, list[str]], list[str]]:
    """vLLM parameter -> the checkpoint tensors it is made of, in order, for the parameters whose every part
    is among `names`; and the parameters left out because only some of their parts are."""
    parts: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for name in names:
        if layout.tie_word_embeddings and name == "lm_head.weight":
            continue
        mapped = vllm_name(name)
        if mapped is None:
            continue
        target, index, count = mapped
        parts.setdefault(target, {})[index] = name
        counts[target] = count
    whole = {t: [p[i] for i in range(counts[t])] for t, p in parts.items() if len(p) == counts[t]}
    partial = sorted(t for t, p in parts.items() if len(p) != counts[t])
    return whole, partial


def vocab_padding_rows(name: str, rows: int) -> int:
    return (-rows % VOCAB_PADDING) if name in PADDED_VOCAB else 0


def parameter_hash(chunks: Iterable[Any]) -> str:
    """sha256 hex of byte chunks back to back (bytes, numpy arrays, or torch tensors: a CPU copy of their
    raw bytes, as vLLM takes it)."""
    h = hashlib.sha256()
    for c in chunks:
        h.update(_raw(c))
    return h.hexdigest()


def _raw(chunk: Any) -> Any:
    """The chunk's bytes, as a buffer hashlib reads."""
    if isinstance(chunk, bytes | bytearray | memoryview):
        return chunk
    if type(chunk).__module__.startswith("torch"):
        import torch

        flat = chunk.detach().contiguous().view(-1).view(torch.uint8).cpu()
        return flat.numpy()
    import numpy as np

    return np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)


def _nbytes(chunk: Any) -> int:
    if isinstance(chunk, bytes | bytearray | memoryview):
        return len(chunk)
    if hasattr(chunk, "nbytes"):
        return int(chunk.nbytes)
    return int(chunk.numel()) * int(chunk.element_size())


def digest_named_tensors(named: Iterable[tuple[str, Any]], layout: ModelLayout) -> Digest:
    """The digest of torch tensors (copied to the CPU, as vLLM hashes them) or numpy arrays, by checkpoint
    name."""
    started = time.perf_counter()
    why = layout.unavailable()
    if why is not None:
        return Digest(unavailable=why)
    tensors = dict(named)
    whole, _partial = plan(tensors, layout)
    out: dict[str, str] = {}
    for target, names in whole.items():
        chunks = [tensors[n] for n in names]
        first = chunks[0]
        rows = int(first.shape[0]) if len(first.shape) >= 1 else 0
        pad = vocab_padding_rows(target, rows) if rows else 0
        if pad:
            chunks.append(bytes(pad * (_nbytes(first) // rows)))
        out[target] = parameter_hash(chunks)
    return Digest(out, seconds=time.perf_counter() - started)


def read_index(path: Path) -> dict[str, tuple[Path, tuple[int, ...], int, int]]:
    """Every tensor of the safetensors files at `path`: (file, shape, start, end) byte offsets."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors file at {path}")
    index: dict[str, tuple[Path, tuple[int, ...], int, int]] = {}
    for f in files:
        with f.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, meta in header.items():
            if name != "__metadata__":
                lo, hi = meta["data_offsets"]
                index[name] = (f, tuple(meta["shape"]), 8 + length + lo, 8 + length + hi)
    return index


def checkpoint_layout(path: Path) -> ModelLayout:
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return ModelLayout(None)
    return ModelLayout.from_config(json.loads(config.read_text()))


def checkpoint_digest(path: str | Path, *, layout: ModelLayout | None = None) -> Digest:
    """The digest of a safetensors checkpoint as vLLM will hold it once `reload_weights` loaded it (in the
    checkpoint's dtype: vLLM's `--dtype` must be it). `layout` defaults to its config.json."""
    started = time.perf_counter()
    path = Path(path)
    layout = layout or checkpoint_layout(path)
    why = layout.unavailable()
    if why is not None:
        return Digest(unavailable=why)
    index = read_index(path)
    whole, _partial = plan(index, layout)
    out: dict[str, str] = {}
    for target, names in whole.items():
        chunks: list[bytes] = []
        for n in names:
            f, _, lo, hi = index[n]
            with f.open("rb") as fh:
                fh.seek(lo)
                chunks.append(fh.read(hi - lo))
        shape = index[names[0]][1]
        pad = vocab_padding_rows(target, shape[0]) if shape else 0
        if pad:
            chunks.append(bytes(pad * (len(chunks[0]) // max(1, shape[0]))))
        out[target] = parameter_hash(chunks)
    return Digest(out, seconds=time.perf_counter() - started)
