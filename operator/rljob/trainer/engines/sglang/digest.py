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

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.trainer.engines.digests import Digest as Digest  # re-exported: the SDK's digest type
from rljob.trainer.engines.parameters import LoaderNames, Stored
from rljob.trainer.engines.parameters import ModelLayout as ModelLayout  # re-exported: the SDK's
from rljob.trainer.engines.parameters import checkpoint_layout as checkpoint_layout  # re-exported
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
LOADER = LoaderNames(
    engine="SGLang",
    stacked=STACKED,
    dropped=SKIPPED,
    padded_vocab=PADDED_VOCAB,
    vocab_padding=VOCAB_PADDING,
    known_layouts=KNOWN_LAYOUTS,
    quantized="hashes its dequantized weights",
)
sglang_name = LOADER.target  # the SGLang parameter a checkpoint tensor loads into (or None: skipped)
plan = LOADER.plan  # SGLang parameter -> the checkpoint tensors it is made of
_vocab_padding_rows = LOADER.padding_rows  # the zero rows SGLang pads a parameter with


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
    why = LOADER.unavailable(layout)
    if why is not None:
        return PendingDigest([], None, unavailable=why)
    targets: list[str] = []
    groups: list[tensor_hash.Group] = []
    for target, items, zero in LOADER.parameters(dict(named), layout, _size):
        targets.append(target)
        groups.append((items, zero))
    hashes = tensor_hash.start_hashes(groups)
    return PendingDigest(targets, hashes, seconds=time.perf_counter() - started)


def _size(tensor: Any) -> tuple[tuple[int, ...], int]:
    return tuple(tensor.shape), int(tensor.nbytes)


# --- checkpoints on disk ---------------------------------------------------------------------------


def checkpoint_digest(
    path: str | Path, *, device: str | None = None, layout: ModelLayout | None = None
) -> Digest:
    """The digest of a safetensors checkpoint as SGLang will hold it once `update_weights_from_disk` loaded
    it: on the CPU with numpy, or with torch on `device` (e.g. "cuda": the files' bytes are copied there
    and hashed at the GPU's speed). `layout` defaults to the checkpoint's config.json."""
    maps: dict[Path, Any] = {}

    def hash_parameter(stored: list[Stored], zero: int) -> str:
        chunks = [_file_bytes(maps, s) for s in stored] + ([bytes(zero)] if zero else [])
        return tensor_hash.hex16(_hash_chunks(chunks, device))

    return LOADER.checkpoint_digest(path, layout, hash_parameter)


def _file_bytes(maps: dict[Path, Any], s: Stored) -> Any:
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
