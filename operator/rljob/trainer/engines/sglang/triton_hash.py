"""SGLang's tensor hash (the algorithm: tensor_hash.py beside it) as the SDK's own Triton kernel, for
tensors on CUDA: one launch per parameter, one host sync per digest.

A launch hashes one parameter given as up to `MAX_PARTS` parts taken back to back, plus zero bytes after
them (a fused parameter's parts, the vocabulary's padding rows), without writing their concatenation: each
program is one tile of the concatenation (`TILE_WORDS` words), and the word index u runs across the parts.
When every part is word-aligned (its size and its address multiples of 4 bytes), a tile that lies in one
part (most tiles) is read from that part alone, word by word with no masks; any other tile reads each word
from the part that holds it, and past the parts reads zeros. A part of an odd size or at an odd address
makes every word of its parameter be assembled from its 4 bytes, each from the part that holds it. Each
program adds its tile's 64-bit value into the parameter's slot of a uint64 buffer (an atomic add: the
tiles' sum mod 2**64 whatever their order); `finish` reads the whole buffer once and applies splitmix64's
finalizer on the host.

`Batch` hashes a digest's parameters on a side stream per device: it waits for the work the current stream
had queued (what wrote the tensors), launches, and returns; `release` makes the current stream wait for the
hash (the tensors may then be changed or freed), and `result` waits once and reads the buffer.

tensor_hash imports this module only for tensors on CUDA; it imports triton (`AVAILABLE`: whether triton
imports here) and torch only when it hashes. Under TRITON_INTERPRET=1 (set before this module is
imported) the same kernel runs on CPU tensors (tests/unit/test_tensor_hash.py).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (the kernels are Triton's: their arguments are typed by Triton at launch)

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rljob.trainer.engines.sglang import tensor_hash as th

try:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]
except ImportError:  # the torch path hashes instead (tensor_hash.hash_tensors)
    AVAILABLE = False
else:
    AVAILABLE = True

MAX_PARTS = 4  # parts a launch reads; more are concatenated first (a fused parameter has at most 3)
BLOCK_WORDS = 2048  # words a program hashes per step: TILE_WORDS / BLOCK_WORDS steps per tile
NUM_WARPS = 8  # with BLOCK_WORDS: 8 words a thread a step, 98 registers on sm_90 (ptxas -v), no spills

if AVAILABLE:
    _SEED1 = tl.constexpr(th.SEED1)
    _SEED2 = tl.constexpr(th.SEED2)
    _POS_A = tl.constexpr(th.POS_A)
    _POS_B = tl.constexpr(th.POS_B)
    _FMIX_C1 = tl.constexpr(th.FMIX_C1)
    _FMIX_C2 = tl.constexpr(th.FMIX_C2)
    _TILE = tl.constexpr(th.TILE_WORDS)

    @triton.jit
    def _u32(c: tl.constexpr):
        return tl.full((), c, tl.uint32)

    @triton.jit
    def _fmix32(x):
        x = x ^ (x >> 16)
        x = x * _u32(_FMIX_C1)
        x = x ^ (x >> 13)
        x = x * _u32(_FMIX_C2)
        return x ^ (x >> 16)

    @triton.jit
    def _position(u, a: tl.constexpr, seed: tl.constexpr, r: tl.constexpr):
        """p1 or p2 of the word at index u: (u * a + seed) ^ rotl(u, r), mod 2**32."""
        return (u * _u32(a) + _u32(seed)) ^ ((u << r) | (u >> (32 - r)))

    @triton.jit
    def _keys(word, u):
        """The word's keys k1 and k2 at index u (mod 2**32)."""
        k1 = _fmix32(word ^ _position(u, _POS_A, _SEED1, 15))
        k2 = _fmix32(word ^ _position(u, _POS_B, _SEED2, 13))
        return k1, k2

    @triton.jit
    def _one_part_tile(p, first, BLOCK: tl.constexpr):
        """Sums of k1 and k2 over the whole tile starting at word `first`, every word in part p (which
        points to the tile's first word)."""
        sum1 = tl.zeros((BLOCK,), tl.uint32)
        sum2 = tl.zeros((BLOCK,), tl.uint32)
        u0 = first.to(tl.uint32)
        for step in tl.static_range(0, _TILE, BLOCK):
            offs = step + tl.arange(0, BLOCK)
            word = tl.load(p + offs).to(tl.uint32, bitcast=True)
            k1, k2 = _keys(word, u0 + offs.to(tl.uint32))
            sum1 += k1
            sum2 += k2
        return tl.sum(sum1, axis=0).to(tl.uint32), tl.sum(sum2, axis=0).to(tl.uint32)

    @triton.jit
    def _part(word, idx, live, p, lo, hi, BYTES: tl.constexpr):
        """`word` with the bits part p holds of the words `idx`: [lo, hi) is where the part lies in the
        concatenation, in bytes (BYTES: p points to bytes) or in words (p points to 32-bit words)."""
        if BYTES:
            for b in tl.static_range(4):
                at = idx * 4 + b
                byte = tl.load(p + (at - lo), mask=live & (at >= lo) & (at < hi), other=0)
                word = word | (byte.to(tl.uint32) << (8 * b))
        else:
            w = tl.load(p + (idx - lo), mask=live & (idx >= lo) & (idx < hi), other=0)
            word = word | w.to(tl.uint32, bitcast=True)
        return word

    @triton.jit
    def _any_tile(first, n_words, p0, lo0, hi0, p1, lo1, hi1, p2, lo2, hi2, p3, lo3, hi3,
                  BYTES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Sums of k1 and k2 over the tile starting at word `first`: words from any part, the zeros after
        them, the end."""
        sum1 = tl.zeros((BLOCK,), tl.uint32)
        sum2 = tl.zeros((BLOCK,), tl.uint32)
        for step in tl.static_range(0, _TILE, BLOCK):
            idx = first + step + tl.arange(0, BLOCK)
            live = idx < n_words
            word = tl.zeros((BLOCK,), tl.uint32)  # past the parts: the zero bytes that follow them
            word = _part(word, idx, live, p0, lo0, hi0, BYTES)
            word = _part(word, idx, live, p1, lo1, hi1, BYTES)
            word = _part(word, idx, live, p2, lo2, hi2, BYTES)
            word = _part(word, idx, live, p3, lo3, hi3, BYTES)
            k1, k2 = _keys(word, idx.to(tl.uint32))
            sum1 += tl.where(live, k1, tl.zeros_like(k1))  # lanes past the end count 0
            sum2 += tl.where(live, k2, tl.zeros_like(k2))
        return tl.sum(sum1, axis=0).to(tl.uint32), tl.sum(sum2, axis=0).to(tl.uint32)

    @triton.jit(do_not_specialize=["slot"])
    def _hash_tiles(  # one program per tile of the concatenation
        out, slot, n_words, nbytes32,
        p0, lo0, hi0, p1, lo1, hi1, p2, lo2, hi2, p3, lo3, hi3,
        BYTES: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        first = tl.program_id(0).to(tl.int64) * _TILE
        end = first + _TILE
        # Most tiles lie in one part (word-aligned): read it alone, every word live, no masks.
        in0 = (lo0 <= first) & (end <= hi0)
        in1 = (lo1 <= first) & (end <= hi1)
        in2 = (lo2 <= first) & (end <= hi2)
        in3 = (lo3 <= first) & (end <= hi3)
        if (not BYTES) and (in0 | in1 | in2 | in3):
            p = tl.where(in1, p1, tl.where(in2, p2, tl.where(in3, p3, p0)))
            lo = tl.where(in1, lo1, tl.where(in2, lo2, tl.where(in3, lo3, lo0)))
            s1, s2 = _one_part_tile(p + (first - lo), first, BLOCK)
        else:
            s1, s2 = _any_tile(first, n_words, p0, lo0, hi0, p1, lo1, hi1, p2, lo2, hi2, p3, lo3, hi3,
                               BYTES, BLOCK)  # fmt: skip
        nbytes = tl.full((), nbytes32, tl.uint32)
        h1 = _fmix32(s1 ^ nbytes)
        h2 = _fmix32(s2 ^ nbytes)
        tile = (h1.to(tl.uint64) << 32) | h2.to(tl.uint64)
        tl.atomic_add(out + slot, tile, sem="relaxed")


def _flat_bytes(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _whole_words(f: Any) -> bool:
    """A part that can be read as 32-bit words: its size and its address multiples of 4 bytes."""
    return bool(f.numel() % 4 == 0 and f.data_ptr() % 4 == 0 and f.storage_offset() % 4 == 0)


def launch(parts: Sequence[Any], zero_bytes: int, out: Any, slot: int) -> None:
    """Add the tiles of the hash of `parts` (torch tensors of one device, any dtype, taken back to back)
    followed by `zero_bytes` zero bytes into `out[slot]` (uint64, zeroed), on the current stream."""
    import torch

    flat = [f for f in (_flat_bytes(p) for p in parts) if f.numel()]
    if len(flat) > MAX_PARTS:
        flat = [torch.cat(flat)]
    total = sum(int(f.numel()) for f in flat) + int(zero_bytes)
    n_words = -(-total // 4)
    if n_words == 0:
        return  # the slot stays 0: splitmix64(0) == 0, the hash of an empty tensor
    whole_words = all(_whole_words(f) for f in flat)
    args: list[Any] = []
    at = 0
    for f in flat:
        n = int(f.numel())
        if whole_words:
            args += [f.view(torch.int32), at // 4, (at + n) // 4]
        else:
            args += [f, at, at + n]
        at += n
    unused = args[0] if args else out.view(torch.int32 if whole_words else torch.uint8)
    while len(args) < 3 * MAX_PARTS:  # unused parts (and part 0 when only zeros): empty, never read
        args += [unused, 0, 0]
    grid = (-(-n_words // th.TILE_WORDS),)
    _hash_tiles[grid](
        out, slot, n_words, (4 * n_words) & th.MASK32, *args,
        BYTES=not whole_words, BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS,
    )  # fmt: skip


def new_slots(n: int, device: Any) -> Any:
    """A digest's buffer: a zeroed uint64 slot per parameter."""
    import torch

    return torch.zeros(n, dtype=torch.int64, device=device).view(torch.uint64)


def finish(out: Any) -> list[int]:
    """The hashes of `out`'s slots: one read of the buffer (the digest's one sync), splitmix64 on the host."""
    import torch

    raw = out.view(torch.int64).cpu().tolist()
    return [th.splitmix64(int(v)) for v in raw]


def hash_parts(parts: Sequence[Any], zero_bytes: int = 0) -> int:
    """The hash of `parts` back to back (then `zero_bytes` zeros), on their device's current stream."""
    out = new_slots(1, parts[0].device if parts else "cpu")
    launch(parts, zero_bytes, out, 0)
    return finish(out)[0]


_SIDE_STREAMS: dict[Any, Any] = {}  # per device, reused by every digest


def side_stream(device: Any) -> Any:
    import torch

    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    return stream


class Batch:
    """Hashes of several parameters (each: its parts on one CUDA device, the zero bytes after them) on a
    side stream per device; `result()` waits once per device."""

    def __init__(self, groups: Sequence[tuple[Sequence[Any], int]]) -> None:
        import torch

        by_device: dict[Any, list[int]] = {}
        for i, (parts, _zero) in enumerate(groups):
            by_device.setdefault(parts[0].device, []).append(i)
        self._out: dict[Any, Any] = {}
        self._inputs = groups  # referenced until released: their memory stays theirs while hashed
        for device, indices in by_device.items():
            side = side_stream(device)
            with torch.cuda.device(device):
                side.wait_stream(torch.cuda.current_stream(device))  # what wrote the tensors, first
            with torch.cuda.device(device), torch.cuda.stream(side):
                out = self._out[device] = new_slots(len(indices), device)
                for slot, i in enumerate(indices):
                    parts, zero = groups[i]
                    launch(parts, zero, out, slot)
        where = {i: (device, slot) for device, idx in by_device.items() for slot, i in enumerate(idx)}
        self._slots = [where[i] for i in range(len(groups))]  # per group: (device, slot)

    def release(self) -> None:
        """From here the work queued on each device's current stream runs after the hash: the tensors
        may be changed or freed."""
        import torch

        for device in self._out:
            torch.cuda.current_stream(device).wait_stream(side_stream(device))
        self._inputs = ()

    def result(self) -> list[int]:
        import torch

        values: dict[Any, list[int]] = {}
        for device, out in self._out.items():
            with torch.cuda.device(device), torch.cuda.stream(side_stream(device)):
                values[device] = finish(out)
        self._inputs = ()
        return [values[device][slot] for device, slot in self._slots]
