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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rljob.trainer.engines.digests import Digest
from rljob.trainer.engines.parameters import LoaderNames, Stored
from rljob.trainer.engines.parameters import ModelLayout as ModelLayout  # re-exported: the SDK's

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
LOADER = LoaderNames(
    engine="vLLM",
    stacked=STACKED,
    dropped=DROPPED,
    padded_vocab=PADDED_VOCAB,
    vocab_padding=VOCAB_PADDING,
    known_layouts=KNOWN_LAYOUTS,
    quantized="hashes the quantized parameters it builds",
)
vllm_name = LOADER.target  # the vLLM parameter a checkpoint tensor loads into (or None: dropped)


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


def _size(chunk: Any) -> tuple[tuple[int, ...], int]:
    return tuple(chunk.shape), _nbytes(chunk)


def _hash_parts(parts: list[Any], zero: int) -> str:
    return parameter_hash([*parts, bytes(zero)] if zero else parts)


def digest_named_tensors(named: Iterable[tuple[str, Any]], layout: ModelLayout) -> Digest:
    """The digest of torch tensors (copied to the CPU, as vLLM hashes them) or numpy arrays, by checkpoint
    name."""
    return LOADER.digest(named, layout, _size, _hash_parts)


def checkpoint_digest(path: str | Path, *, layout: ModelLayout | None = None) -> Digest:
    """The digest of a safetensors checkpoint as vLLM will hold it once `reload_weights` loaded it (in the
    checkpoint's dtype: vLLM's `--dtype` must be it). `layout` defaults to its config.json."""
    return LOADER.checkpoint_digest(path, layout, _hash_stored)


def _hash_stored(stored: list[Stored], zero: int) -> str:
    return _hash_parts([s.read() for s in stored], zero)
