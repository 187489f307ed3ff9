"""Packing a trainer's named tensors into the payloads SGLang's `update_weights_from_tensor` reads with
`load_format="flattened_bucket"`, and the bucket buffers that are reused from one refit to the next.

One push (one bucket) carries one payload per TP rank; each payload is

    base64(pickle({"flattened_tensor": <1-D uint8 CUDA tensor>,
                   "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}))

which is what SGLang's scheduler deserializes (its own rank's entry, C-ROUTE-TENSOR-FORMAT) with
`MultiprocessingSerializer.deserialize` (base64, then a restricted unpickler: C-REFIT-TENSOR-B64,
C-REFIT-TENSOR-PICKLE) and hands to `_update_weights_from_flattened_bucket` (C-ROUTE-TENSOR-FORMAT,
C-REFIT-TENSOR-META), which slices `flattened_tensor[start_idx:end_idx]`, views it as `dtype`
and reshapes it to `shape`; `start_idx`, `end_idx` and `numel` count bytes of the uint8 buffer
(C-REFIT-BUCKET-LAYOUT). The CUDA tensor is pickled as torch's own CUDA IPC reduction
(`torch.multiprocessing.reductions.reduce_tensor`): a handle to the allocation, not its bytes, with the
device given as its UUID, as SGLang's `monkey_patch_torch_reductions` sends it (C-REFIT-IPC-DEVICE):
trainer and server containers may number the GPUs differently. Every version this project supports
(0.5.6 to 0.5.23) reads this format.

This module writes the pickle itself (`dumps`: a small opcode writer, no torch needed for the envelope,
so CI can check the format without torch), and never imports sglang: SGLang's own serializer took 2.2 to
8.3 s to import in a trainer (tests/gpu/RESULTS.md), which a trainer that pushes right after its lease
paid inside the refit, and it patches torch's reductions process-wide. SGLang's own receive path reads
these payloads byte for byte (tests/unit/test_sglang_reads_payloads.py). The class of the metadata must
be named `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`: both SGLang allowlists accept
it and the receiver reads its attributes.

Buckets hold one dtype each: a slice of a uint8 buffer can only be viewed as a dtype at an offset that is
a multiple of its size, and on SGLang's tensor route a misaligned view is fatal (C-REFIT-BUCKET-LAYOUT).

Bucket buffers: a ring per device, allocated once and reused for every bucket of every refit. The same
allocation gives the same IPC handle, so the server side's per-handle work is the same each time, and no
memory is allocated or freed while SGLang maps it. Each bucket is packed while the previous push is in
flight (RefitSession sends from a thread), so the buffer it overwrites must be free while one push is
still out. With TP=1 a push SGLang answered is done with its buffer (its only rank copied from it and
dropped the mapping, after a stream sync, before answering): the buffer of the push before the one in
flight will do, a ring of 2. With TP > 1 rank 0 answers after the call's TP barrier, and the other ranks
may drop their mapping only after it (C-REFIT-TENSOR-TP); they are done with it only once the next push was
answered too: a ring of 3 (`ring_size`).

torch is imported only by the functions that touch tensors (`pack_and_serialize`, `BucketBuffers`).
"""

from __future__ import annotations

import base64
import functools
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The faster bucket size measured on the H200 (tests/gpu/RESULTS.md); two reused buffers a device hold 4 GiB.
DEFAULT_BUCKET_BYTES = 2 << 30
LOAD_FORMAT = "flattened_bucket"
REBUILD_CUDA_DEVICE_ARG = 6  # index of the device in reduce_tensor's rebuild args (C-REFIT-IPC-DEVICE)

# --- planning (no torch) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What planning needs to know about one named tensor."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    device: str = ""  # buckets never mix devices


@dataclass(frozen=True)
class Placement:
    index: int  # position of the tensor in the input
    start: int  # byte offsets in the bucket, end exclusive
    end: int


@dataclass(frozen=True)
class BucketPlan:
    dtype: str
    device: str
    placements: tuple[Placement, ...]

    @property
    def nbytes(self) -> int:
        return self.placements[-1].end if self.placements else 0


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[BucketPlan]:
    """Buckets of at most `bucket_bytes`, one (device, dtype) each, in first-seen order of (device, dtype)
    and input order within; a tensor larger than `bucket_bytes` gets a bucket of its own. Offsets are
    contiguous (no padding), as SGLang's FlattenedTensorBucket lays them out."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    if not specs:
        raise ValueError("no tensors to push: SGLang refuses an empty bucket")
    groups: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(specs):
        if s.nbytes < 0:
            raise ValueError(f"tensor {s.name!r} has a negative size")
        groups.setdefault((s.device, s.dtype), []).append(i)
    plans: list[BucketPlan] = []
    for (device, dtype), indices in groups.items():
        current: list[Placement] = []
        offset = 0
        for i in indices:
            n = specs[i].nbytes
            if current and offset + n > bucket_bytes:
                plans.append(BucketPlan(dtype, device, tuple(current)))
                current, offset = [], 0
            current.append(Placement(i, offset, offset + n))
            offset += n
        plans.append(BucketPlan(dtype, device, tuple(current)))
    return plans


# --- the pickle, written without torch --------------------------------------------------------------


@dataclass(frozen=True)
class Global:
    """A module-level name as pickle refers to it (GLOBAL opcode): a class, a function, a dtype."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """`func(*args)` when unpickled (REDUCE): how torch.Size and rebuilt tensors are pickled."""

    func: Global
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Instance:
    """`cls.__new__(cls)` then `__dict__.update(state)` (NEWOBJ + BUILD): how pickle writes a dataclass
    instance at protocol >= 2."""

    cls: Global
    state: dict[str, Any]


@dataclass(frozen=True)
class Raw:
    """Pickle opcodes written as they are: a value `fragment` wrote before (no PROTO, no STOP, no memo)."""

    data: bytes


METADATA_CLASS = Global("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
TORCH_SIZE = Global("torch", "Size")

_PROTO, _STOP, _MARK = b"\x80", b".", b"("
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_BININT1, _BININT2, _BININT, _LONG1 = b"K", b"M", b"J", b"\x8a"
_SHORT_BINUNICODE, _BINUNICODE = b"\x8c", b"X"
_SHORT_BINBYTES, _BINBYTES = b"C", b"B"
_EMPTY_TUPLE, _TUPLE, _TUPLE1, _TUPLE2, _TUPLE3 = b")", b"t", b"\x85", b"\x86", b"\x87"
_EMPTY_LIST, _APPENDS, _EMPTY_DICT, _SETITEMS = b"]", b"e", b"}", b"u"
_GLOBAL, _REDUCE, _NEWOBJ, _BUILD = b"c", b"R", b"\x81", b"b"


def dumps(obj: Any) -> bytes:
    """Protocol-4 pickle of None, bool, int, str, bytes, tuple, list, dict, Global, Call and Instance,
    without memo entries (what the standard unpickler and SGLang's SafeUnpickler read)."""
    out = [_PROTO, b"\x04"]
    _write(obj, out)
    out.append(_STOP)
    return b"".join(out)


def _write_sized(raw: bytes, short_op: bytes, long_op: bytes, out: list[bytes]) -> None:
    """A string's or bytes' opcode, its length (one byte under 256, else four) and the bytes."""
    size = bytes([len(raw)]) if len(raw) < 256 else struct.pack("<I", len(raw))
    out += [short_op if len(raw) < 256 else long_op, size, raw]


def _write(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(_NONE)
    elif obj is True or obj is False:
        out.append(_TRUE if obj else _FALSE)
    elif isinstance(obj, int):
        _write_int(obj, out)
    elif isinstance(obj, str):
        _write_sized(obj.encode("utf-8", "surrogatepass"), _SHORT_BINUNICODE, _BINUNICODE, out)
    elif isinstance(obj, bytes):
        _write_sized(obj, _SHORT_BINBYTES, _BINBYTES, out)
    elif isinstance(obj, tuple):
        if len(obj) <= 3:
            for x in obj:
                _write(x, out)
            out.append((_EMPTY_TUPLE, _TUPLE1, _TUPLE2, _TUPLE3)[len(obj)])
        else:
            out.append(_MARK)
            for x in obj:
                _write(x, out)
            out.append(_TUPLE)
    elif isinstance(obj, list):
        out.append(_EMPTY_LIST)
        if obj:
            out.append(_MARK)
            for x in obj:
                _write(x, out)
            out.append(_APPENDS)
    elif isinstance(obj, dict):
        out.append(_EMPTY_DICT)
        if obj:
            out.append(_MARK)
            for k, v in obj.items():
                _write(k, out)
                _write(v, out)
            out.append(_SETITEMS)
    elif isinstance(obj, Global):
        if "\n" in obj.module or "\n" in obj.name:
            raise ValueError(f"bad global {obj}")
        out += [_GLOBAL, obj.module.encode(), b"\n", obj.name.encode(), b"\n"]
    elif isinstance(obj, Call):
        _write(obj.func, out)
        _write(tuple(obj.args), out)
        out.append(_REDUCE)
    elif isinstance(obj, Instance):
        _write(obj.cls, out)
        out.append(_EMPTY_TUPLE)
        out.append(_NEWOBJ)
        _write(dict(obj.state), out)
        out.append(_BUILD)
    elif isinstance(obj, Raw):
        out.append(obj.data)
    else:
        raise TypeError(f"cannot pickle {type(obj).__name__} here")


def _write_int(n: int, out: list[bytes]) -> None:
    if 0 <= n < 0x100:
        out += [_BININT1, bytes([n])]
    elif 0 <= n < 0x10000:
        out += [_BININT2, struct.pack("<H", n)]
    elif -(1 << 31) <= n < (1 << 31):
        out += [_BININT, struct.pack("<i", n)]
    else:
        raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
        if len(raw) > 255:
            raise ValueError("integer too large")
        out += [_LONG1, bytes([len(raw)]), raw]


def metadata_entry(name: str, shape: Sequence[int], dtype: str, start: int, end: int) -> Instance:
    """One FlattenedTensorMetadata (C-REFIT-TENSOR-META), attributes in its field order."""
    return Instance(
        METADATA_CLASS,
        {
            "name": name,
            "shape": Call(TORCH_SIZE, (tuple(int(d) for d in shape),)),
            "dtype": Global("torch", dtype),
            "start_idx": start,
            "end_idx": end,
            "numel": end - start,  # bytes of the uint8 view (C-REFIT-BUCKET-LAYOUT)
        },
    )


def bucket_payload(flattened_tensor: Any, metadata: list[Instance] | Raw) -> bytes:
    """The pickled dict `_update_weights_from_flattened_bucket` reads; `flattened_tensor` is the tensor's
    reduction (a Call) as `reduced_tensor` returns it, `metadata` the entries or their `fragment`."""
    return dumps({"flattened_tensor": flattened_tensor, "metadata": metadata})


def fragment(obj: Any) -> Raw:
    """`obj` as the opcodes `dumps` writes for it, to be written again as they are."""
    out: list[bytes] = []
    _write(obj, out)
    return Raw(b"".join(out))


# (name, shape, dtype, start, end) of each entry of a bucket
MetadataKey = tuple[tuple[str, tuple[int, ...], str, int, int], ...]


@functools.lru_cache(maxsize=1024)
def metadata_fragment(key: MetadataKey) -> Raw:
    """A bucket's metadata list, written once: every refit of a model sends the same buckets, and writing
    ~40 entries took 0.8 ms a bucket on a 2-core CPU, beside the push in flight."""
    return fragment([metadata_entry(*entry) for entry in key])


def to_wire(payload: bytes) -> str:
    """Base64, as MultiprocessingSerializer.serialize(output_str=True) and the JSON route expect."""
    return base64.b64encode(payload).decode("ascii")


# --- tensors (torch, imported lazily) ---------------------------------------------------------------


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ModuleNotFoundError(
            "push_named_tensors needs torch in the trainer (pip install 'rljob-operator[train]')",
            name="torch",
        ) from e
    return torch


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 -> "bfloat16": the attribute of the torch module pickle refers to."""
    return str(dtype).removeprefix("torch.")


def _reduced_arg(a: Any) -> Any:
    torch = _torch()
    if isinstance(a, torch.Size):
        return Call(TORCH_SIZE, (tuple(int(d) for d in a),))
    if isinstance(a, torch.dtype):
        return Global("torch", dtype_name(a))
    if isinstance(a, type):
        return Global(a.__module__, a.__qualname__)
    if a is None or isinstance(a, bool | int | str | bytes):
        return a
    if isinstance(a, tuple):
        return tuple(_reduced_arg(x) for x in a)
    raise TypeError(f"unexpected {type(a).__name__} in torch's tensor reduction")


@functools.cache
def device_uuid(index: int) -> str:
    """What SGLang's patched reduction sends instead of the index (C-REFIT-IPC-DEVICE)."""
    return str(_torch().cuda.get_device_properties(index).uuid)


def reduced_tensor(t: Any) -> Call:
    """torch's ForkingPickler reduction of `t` (for a CUDA tensor: an IPC handle of its allocation, a
    shared reference count and an event), as a Call; a CUDA device index becomes the device's UUID."""
    from torch.multiprocessing import reductions

    func, args = reductions.reduce_tensor(t)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    args = list(args)
    if func is reductions.rebuild_cuda_tensor and isinstance(args[REBUILD_CUDA_DEVICE_ARG], int):
        args[REBUILD_CUDA_DEVICE_ARG] = device_uuid(args[REBUILD_CUDA_DEVICE_ARG])
    return Call(Global(func.__module__, func.__name__), tuple(_reduced_arg(a) for a in args))


def ring_size(tp_size: int) -> int:
    """Bucket buffers per device for TP size `tp_size` (module docstring)."""
    return 2 if tp_size == 1 else 3


class BucketBuffers:
    """The reused bucket buffers: a ring per device (uint8, at least `bucket_bytes` each), allocated on
    first use and kept until `free()`. They cost `ring_size(tp) x bucket_bytes` of the trainer's GPU memory
    per device for as long as they are kept: budget it, or free them after each refit (the next one is
    then cold again)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], Any] = {}
        self._next: dict[str, int] = {}
        self.allocations = 0

    def next_buffer(self, device: Any, nbytes: int, bucket_bytes: int, ring: int) -> Any:
        torch = _torch()
        key = str(device)
        k = self._next.get(key, 0) % ring
        self._next[key] = (k + 1) % ring
        buf = self._buffers.get((key, k))
        if buf is None or buf.numel() < nbytes:
            self._buffers.pop((key, k), None)
            buf = torch.empty(max(nbytes, bucket_bytes), dtype=torch.uint8, device=device)
            self._buffers[(key, k)] = buf
            self.allocations += 1
        return buf

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self._buffers.values())

    def free(self) -> None:
        self._buffers.clear()
        self._next.clear()


@dataclass
class PushReport:
    """What one `push_named_tensors` did. `send_seconds` fills in as the pushes go out; the last one is
    sent when the refit window closes (it carries the version)."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    order: list[str] = field(default_factory=list)  # names in the byte order the server receives them
    new_buffers: int = 0  # bucket buffers allocated by this call (0: all reused)
    pack_seconds: float = 0.0  # copies into the buckets, their stream synchronized
    serialize_seconds: float = 0.0  # IPC handles, pickle, base64
    ipc_share_seconds: float = 0.0  # of serialize_seconds: torch's reduction (handle, event, ref count)
    send_seconds: list[float] = field(default_factory=list)  # each push's round trip through the agent
    digest_seconds: float = 0.0  # starting the digest's hash, waiting for it at the close (digest.py)


@dataclass
class PackedBucket:
    payloads: list[str]  # one per TP rank
    buffer: Any  # the bucket's buffer: kept referenced until the push was answered
    nbytes: int


def tensor_specs(named: Sequence[tuple[str, Any]]) -> list[TensorSpec]:
    specs = []
    for name, t in named:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        if getattr(t, "device", None) is None or t.device.type != "cuda":
            where = getattr(getattr(t, "device", None), "type", type(t).__name__)
            raise ValueError(
                f"push_named_tensors sends CUDA IPC handles: {name!r} is on {where}; move it to the GPU "
                "or serialize it yourself and use push_tensors"
            )
        specs.append(
            TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), str(t.device))
        )
    return specs


def pack_and_serialize(
    named: Sequence[tuple[str, Any]],
    plan: BucketPlan,
    buffers: BucketBuffers,
    bucket_bytes: int,
    tp_size: int,
    report: PushReport,
) -> PackedBucket:
    """Copy the bucket's tensors into a reused buffer, wait for the copies, and serialize it once per TP
    rank (each rank opens and releases its own copy of the handle, as SGLang's Engine does:
    C-REFIT-TENSOR-TP)."""
    torch = _torch()
    started = time.perf_counter()
    before = buffers.allocations
    device = named[plan.placements[0].index][1].device
    buf = buffers.next_buffer(device, plan.nbytes, bucket_bytes, ring_size(tp_size))
    report.new_buffers += buffers.allocations - before
    for p in plan.placements:
        name, t = named[p.index]
        if p.end > p.start:
            buf[p.start : p.end].view(t.dtype).view(t.shape).copy_(t)
        report.order.append(name)
    flat = buf[: plan.nbytes]
    # The IPC reduction records an event the receiver waits on; synchronizing as well makes the bucket
    # complete whatever the receiver does, and the packing time honest. The copies' stream only: the
    # digest's hash runs on a side stream meanwhile (trainer/engines/sglang/triton_hash.py).
    torch.cuda.current_stream(device).synchronize()
    packed_at = time.perf_counter()
    entries = metadata_fragment(
        tuple(
            (named[p.index][0], tuple(int(d) for d in named[p.index][1].shape), plan.dtype, p.start, p.end)
            for p in plan.placements
        )
    )
    payloads = []
    for _ in range(tp_size):
        shared_at = time.perf_counter()
        reduction = reduced_tensor(flat)
        report.ipc_share_seconds += time.perf_counter() - shared_at
        payloads.append(to_wire(bucket_payload(reduction, entries)))
    report.pack_seconds += packed_at - started
    report.serialize_seconds += time.perf_counter() - packed_at
    report.buckets += 1
    report.tensors += len(plan.placements)
    report.bytes += plan.nbytes
    return PackedBucket(payloads, buf, plan.nbytes)


def prepare(
    named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int, tp_size: int
) -> tuple[list[tuple[str, Any]], list[BucketPlan]]:
    """The named tensors as a list and their buckets; checks them (torch first: without it, say so)."""
    _torch()
    if tp_size < 1:
        raise ValueError("tp_size must be at least 1")
    named = list(named_tensors)
    return named, plan_buckets(tensor_specs(named), bucket_bytes)


def buckets(
    named_tensors: Iterable[tuple[str, Any]],
    buffers: BucketBuffers,
    *,
    bucket_bytes: int,
    tp_size: int,
    report: PushReport,
) -> Iterable[PackedBucket]:
    """The packed buckets in push order, one after the other (RefitSession overlaps packing and sending;
    each bucket yielded here must have been answered before the next but one is packed)."""
    named, plans = prepare(named_tensors, bucket_bytes, tp_size)
    for plan in plans:
        yield pack_and_serialize(named, plan, buffers, bucket_bytes, tp_size, report)
