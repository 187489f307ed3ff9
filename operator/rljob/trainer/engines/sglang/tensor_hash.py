"""SGLang's tensor hash, bit for bit: what `/weights_checker` (action `checksum`) computes per parameter, so
that a trainer's digest of the weights it published can be held against what SGLang holds.

SGLang hashes each parameter with `tensor_hash` (…/managers/mm_utils.py:1218-1247@0.5.15.post1), which for
a CUDA tensor is `gpu_tensor_hash` (…/layers/multimodal.py:20-185@0.5.15.post1; from 0.5.20
sglang/kernels/ops/memory/gpu_tensor_hash.py, the same kernels): the tensor's bytes, zero-padded to whole
32-bit little-endian words w_i, i = 0..n-1, in tiles of 8192 words. Per word, with u = i mod 2**32 and all
arithmetic mod 2**32:

    p1 = (u * 0x27D4EB2D + s1) ^ rotl(u, 15)        s1 = 0x243F6A88
    p2 = (u * 0x165667B1 + s2) ^ rotl(u, 13)        s2 = ((0x243F6A88 * 0x9E3779B1) ^ 0xDEADBEEF) mod 2**32
    k1 = fmix32(w_i ^ p1),  k2 = fmix32(w_i ^ p2)   fmix32: murmur3's finalizer (0x85EBCA6B, 0xC2B2AE35)

per tile t: h1 = fmix32((sum of k1 over the tile) ^ 4n), h2 likewise (4n: the padded byte count), and the
tile's value is h1 * 2**32 + h2; the tiles' values are summed mod 2**64 and the sum goes through
splitmix64's finalizer. An empty tensor hashes to 0. `/weights_checker` writes it as 16 hex digits
(…/utils/weight_checker.py:177-178@0.5.15.post1). A list of tensors hashes as their flattened
concatenation, which is how a fused parameter (qkv_proj = q, k, v) is reproduced from its parts.

Three implementations, all exact: numpy (`hash_words`, for bytes on the CPU: checkpoints read from disk);
the SDK's own Triton kernel for tensors on CUDA where triton imports (triton_hash.py beside this module: one
launch per parameter, a fused parameter's parts read in place, one host sync per digest); and torch ops
on any device where it does not (`hash_tensors_torch`, products split so that no intermediate leaves
int64; a host sync per 8M words). `hash_tensors` picks between the last two; `start_hashes` starts a
digest's hashes on a side CUDA stream and returns before they ran. tests/unit/test_tensor_hash.py holds
them against SGLang's own kernel source, both kernels run by Triton's interpreter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

TILE_WORDS = 8192
SEED = 0x243F6A88
SEED1 = SEED & 0xFFFFFFFF
SEED2 = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
POS_A, POS_B = 0x27D4EB2D, 0x165667B1
MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
CHUNK_WORDS = 1 << 23  # words hashed at once: a multiple of TILE_WORDS (tiles never straddle a chunk)


def hex16(value: int) -> str:
    """How /weights_checker writes a parameter's hash."""
    return f"{value:016x}"


def splitmix64(x: int) -> int:
    """`_final_splitmix64` (…/layers/multimodal.py:129-137@0.5.15.post1)."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


# --- numpy (imported lazily: the SDK itself needs neither numpy nor torch) ------------------------------


def _np_rotl(x: Any, r: int) -> Any:
    import numpy as np

    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _np_fmix32(x: Any) -> Any:
    import numpy as np

    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(FMIX_C1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(FMIX_C2)
    return x ^ (x >> np.uint32(16))


def words_of(data: Any) -> Any:
    """The 32-bit little-endian words SGLang hashes (a numpy array): `data`'s bytes (bytes, a memoryview or a
    numpy array of any dtype) zero-padded to a multiple of 4."""
    import numpy as np

    raw = _raw_bytes(data)
    pad = -raw.size % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    return raw.view("<u4")


def _raw_bytes(data: Any) -> Any:
    import numpy as np

    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def hash_words(words: Any) -> int:
    """SGLang's tensor hash of the words `words_of` gives (numpy, on the CPU)."""
    import numpy as np

    n = int(words.size)
    if n == 0:
        return 0
    nbytes = np.uint32((4 * n) & MASK32)
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, n, CHUNK_WORDS):
            w = words[start : start + CHUNK_WORDS].astype(np.uint32, copy=False)
            u = np.arange(start, start + w.size, dtype=np.uint64).astype(np.uint32)
            k1 = _np_fmix32(w ^ ((u * np.uint32(POS_A) + np.uint32(SEED1)) ^ _np_rotl(u, 15)))
            k2 = _np_fmix32(w ^ ((u * np.uint32(POS_B) + np.uint32(SEED2)) ^ _np_rotl(u, 13)))
            tiles = -(-w.size // TILE_WORDS)
            pad = tiles * TILE_WORDS - w.size  # lanes past the end count 0 (the kernel's mask)
            if pad:
                k1 = np.concatenate([k1, np.zeros(pad, dtype=np.uint32)])
                k2 = np.concatenate([k2, np.zeros(pad, dtype=np.uint32)])
            s1 = k1.reshape(tiles, TILE_WORDS).sum(axis=1, dtype=np.uint64).astype(np.uint32)
            s2 = k2.reshape(tiles, TILE_WORDS).sum(axis=1, dtype=np.uint64).astype(np.uint32)
            h1 = _np_fmix32(s1 ^ nbytes).astype(np.uint64)
            h2 = _np_fmix32(s2 ^ nbytes).astype(np.uint64)
            total = (total + (int(h1.sum(dtype=np.uint64)) << 32) + int(h2.sum(dtype=np.uint64))) & MASK64
    return splitmix64(total)


def hash_bytes(*parts: Any) -> int:
    """The hash of the parts' bytes (bytes, memoryviews, numpy arrays) taken as one tensor: a fused
    parameter's parts in order."""
    import numpy as np

    if len(parts) == 1:
        return hash_words(words_of(parts[0]))
    raw = [_raw_bytes(p) for p in parts]
    return hash_words(words_of(np.concatenate(raw) if raw else np.zeros(0, dtype=np.uint8)))


# --- torch (any device) --------------------------------------------------------------------------------


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2**32 for x < 2**32 in int64, with no intermediate of 2**63 or more: c in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _t_rotl(x: Any, r: int) -> Any:
    return ((x << r) & MASK32) | (x >> (32 - r))


def _t_fmix32(x: Any) -> Any:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_C2)
    return x ^ (x >> 16)


def _t_words(t: Any) -> Any:
    """The tensor's bytes as int64 words (< 2**32) on its device, zero-padded as `_as_uint32_words` pads."""
    import torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() == 0:
        return torch.zeros(0, dtype=torch.int32, device=raw.device)
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    elif raw.storage_offset() % 4:  # a view at an odd address: torch views only whole words as int32
        raw = raw.clone()
    return raw.view(torch.int32)


def hash_tensor(t: Any) -> int:
    """SGLang's tensor hash of a torch tensor (`hash_tensors` of it alone)."""
    return hash_tensors([t])


def hash_tensors(parts: Sequence[Any]) -> int:
    """The hash of the tensors' flattened concatenation (SGLang's `tensor_hash` of a list): by the SDK's
    Triton kernel when they are on one CUDA device and triton imports (triton_hash.py beside this module, the
    concatenation never written), else by torch ops on their device."""
    if _on_one_cuda_device(parts):
        from rljob.trainer.engines.sglang import triton_hash

        if triton_hash.AVAILABLE:
            return triton_hash.hash_parts(parts)
    return hash_tensors_torch(parts)


def hash_tensors_torch(parts: Sequence[Any]) -> int:
    """`hash_tensors` by torch ops on the tensors' device (the concatenation is written first)."""
    import torch

    if len(parts) == 1:
        return _hash_int32_words(_t_words(parts[0]))
    flat = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in parts]
    return _hash_int32_words(_t_words(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)))


def _on_one_cuda_device(parts: Sequence[Any]) -> bool:
    if not parts or not all(type(p).__module__.startswith("torch") for p in parts):
        return False
    return all(p.is_cuda for p in parts) and len({p.device for p in parts}) == 1


def _hash_int32_words(words32: Any) -> int:
    import torch

    n = int(words32.numel())
    if n == 0:
        return 0
    nbytes = (4 * n) & MASK32
    total = 0
    device = words32.device
    for start in range(0, n, CHUNK_WORDS):
        w = words32[start : start + CHUNK_WORDS].to(torch.int64) & MASK32
        u = torch.arange(start, start + w.numel(), dtype=torch.int64, device=device) & MASK32
        k1 = _t_fmix32(w ^ (((_mul32(u, POS_A) + SEED1) & MASK32) ^ _t_rotl(u, 15)))
        k2 = _t_fmix32(w ^ (((_mul32(u, POS_B) + SEED2) & MASK32) ^ _t_rotl(u, 13)))
        tiles = -(-w.numel() // TILE_WORDS)
        pad = tiles * TILE_WORDS - w.numel()
        if pad:
            zeros = torch.zeros(pad, dtype=torch.int64, device=device)
            k1, k2 = torch.cat([k1, zeros]), torch.cat([k2, zeros])
        s1 = k1.view(tiles, TILE_WORDS).sum(dim=1) & MASK32  # < 2**45 before the mask: no overflow
        s2 = k2.view(tiles, TILE_WORDS).sum(dim=1) & MASK32
        h1 = _t_fmix32(s1 ^ nbytes)
        h2 = _t_fmix32(s2 ^ nbytes)
        sums = torch.stack([h1.sum(), h2.sum()]).tolist()  # each < tiles * 2**32: far below 2**63
        total = (total + (int(sums[0]) << 32) + int(sums[1])) & MASK64
    return splitmix64(total)


def hash_any(parts: Iterable[Any]) -> int:
    """The hash of torch tensors, numpy arrays or bytes taken as one flattened tensor, in order."""
    items = list(parts)
    if items and all(type(p).__module__.startswith("torch") for p in items):
        return hash_tensors(items)
    return hash_bytes(*(_as_bytes(p) for p in items))


def _as_bytes(p: Any) -> Any:
    if type(p).__module__.startswith("torch"):
        return p.detach().contiguous().reshape(-1).view(__import__("torch").uint8).cpu().numpy()
    return p


# --- many at once (a digest) ---------------------------------------------------------------------------

Group = tuple[Sequence[Any], int]  # a parameter: its parts in order, and the zero bytes that follow them


class PendingHashes:
    """Hashes `start_hashes` began: those on CUDA may still be running on a side stream."""

    def __init__(self, groups: Sequence[Group]) -> None:
        self._done: dict[int, int] = {}
        on_gpu = [i for i, (parts, _) in enumerate(groups) if _on_one_cuda_device(parts)]
        self._batch: Any = None
        if on_gpu:
            from rljob.trainer.engines.sglang import triton_hash

            if triton_hash.AVAILABLE:
                self._batch = triton_hash.Batch([groups[i] for i in on_gpu])
            else:
                on_gpu = []
        self._on_gpu = on_gpu
        gpu = set(on_gpu)
        for i, (parts, zero) in enumerate(groups):
            if i not in gpu:
                self._done[i] = hash_any([*parts, *_zeros_like(parts, zero)])
        self._count = len(groups)

    def release(self) -> None:
        """The inputs may be changed or freed from here: work queued after this on their devices' current
        streams runs after the hash (no wait here)."""
        if self._batch is not None:
            self._batch.release()

    def result(self) -> list[int]:
        """The hashes, in the groups' order: waits once per device for those still running."""
        if self._batch is not None:
            self._done.update(zip(self._on_gpu, self._batch.result(), strict=True))
            self._batch = None
        return [self._done[i] for i in range(self._count)]


def start_hashes(groups: Sequence[Group]) -> PendingHashes:
    """Start hashing each group (a parameter's parts back to back, then zero bytes): groups on one CUDA
    device by the Triton kernel on a side stream, after the work queued on the current stream (one launch
    per group, nothing waited for); the others (CPU tensors, numpy, bytes; no triton) here and now."""
    return PendingHashes(groups)


def _zeros_like(parts: Sequence[Any], n: int) -> list[Any]:
    if n <= 0:
        return []
    if parts and all(type(p).__module__.startswith("torch") for p in parts):
        import torch

        return [torch.zeros(n, dtype=torch.uint8, device=parts[0].device)]
    return [bytes(n)]
