"""`update_weights_from_tensor` as SGLang's scheduler reads a push, in both memory backends.

Each TP rank deserializes its own entry of `serialized_named_tensors` (base64, then a restricted unpickler)
and loads it by `load_format` (C-ROUTE-TENSOR-FORMAT): "flattened_bucket" takes a dict
{"flattened_tensor", "metadata"} and views `flattened_tensor[start_idx:end_idx]` as each entry's dtype and
shape (C-REFIT-BUCKET-LAYOUT); None or "direct" take a list of (name, tensor), where
a tensor may be a `LocalSerializedTensor(values=[...])` whose `values[tp_rank]` is deserialized again, by the
same unpickler (C-REFIT-TENSOR-LOCAL); any other name is NotImplementedError. All of this runs in the
scheduler, outside any try: a payload that is not a pickle, a blocked or missing global, a missing key or a
view that does not fit kills the server (C-DEATH-EXC, C-REFIT-TENSOR-PICKLE, C-REFIT-TENSOR-META), and so it
does here (`fatal.scheduler_exception`). The allowlist is the version's: module prefixes up to 0.5.20, exact
globals from 0.5.21 (C-REFIT-TENSOR-PICKLE).

- accounting backend (no torch): the pickle is read with stand-ins for torch's classes, dtypes and rebuild
  functions, so names, dtypes, shapes, byte ranges and load_format are checked as SGLang would, and the
  checksum is sha256 over the payload bytes, as before.
- cuda backend: the pickle is read with torch: the CUDA IPC handles are opened (torch's
  `rebuild_cuda_tensor`, the device given by index or UUID as SGLang's patched reduction accepts:
  C-REFIT-IPC-DEVICE), each bucket's bytes are copied into the weights region, one bucket after the other
  from offset 0, and the rebuilt tensors are dropped (which closes the handles), as SGLang drops them when
  the call returns (C-REFIT-TENSOR-TP). The checksum then served is `device_checksum` over the bytes
  written, computed on the GPU when first asked for (not part of the refit's time).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import logging
import math
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rljob.emulator import fatal
from rljob.emulator.parameters import Loaded, Unseen
from rljob.emulator.weights import LoadedWeights

if TYPE_CHECKING:
    from rljob.emulator.engine import Engine

log = logging.getLogger("sglang.emulator")

ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "short": 2, "uint16": 2, "int32": 4, "int": 4,
    "uint32": 4, "int64": 8, "long": 8, "uint64": 8, "float16": 2, "half": 2, "bfloat16": 2,
    "float32": 4, "float": 4, "float64": 8, "double": 8, "complex64": 8, "cfloat": 8,
    "complex128": 16, "cdouble": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}  # fmt: skip
TORCH_TYPE_NAME = {"uint8": "Byte", "bfloat16": "BFloat16", "float16": "Half", "float32": "Float"}

# Up to 0.5.20: any global under these modules, plus ADDED_PREFIXES by version (C-REFIT-TENSOR-PICKLE).
ALLOWED_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
    "weakref.", "torch.", "multiprocessing.resource_sharer.", "multiprocessing.reduction.",
    "pickletools.", "peft.", "transformers.", "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.model_executor.model_runner.",
    "sglang.srt.layers.", "sglang.srt.utils.",
)  # fmt: skip
ADDED_PREFIXES = (
    ((0, 5, 10), ("torch_npu.",)),
    ((0, 5, 15), ("sglang.srt.disaggregation.", "sglang.srt.managers.")),
    ((0, 5, 20), ("sglang.srt.model_executor.model_runner_components.weight_updater.",)),
)
DENIED = {("builtins", n) for n in ("eval", "exec", "compile")} | {
    ("os", "system"), ("subprocess", "Popen"), ("subprocess", "run"), ("codecs", "decode"),
    ("types", "CodeType"), ("types", "FunctionType"),
}  # fmt: skip
# From 0.5.21: these exact globals, of those a tensor push can contain (C-REFIT-TENSOR-PICKLE).
ALLOWED_GLOBALS = {
    *(("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset",
                               "int", "list", "range", "set", "slice", "str", "tuple")),
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("copyreg", "__newobj__"),
    ("copyreg", "__newobj_ex__"), ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
    ("torch", "dtype"), ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    *(("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                   "_rebuild_parameter", "_rebuild_meta_tensor_no_storage")),
    ("torch._tensor", "_rebuild_from_type_v2"),
    *(("torch.multiprocessing.reductions", n) for n in ("rebuild_tensor", "rebuild_meta_tensor",
                                                       "rebuild_cuda_tensor", "rebuild_storage_fd",
                                                       "rebuild_storage_filename", "rebuild_typed_storage")),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    *(("torch", n) for n in ITEMSIZE),
}  # fmt: skip
REBUILD_CUDA = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
}
REBUILD_META = ("torch.multiprocessing.reductions", "rebuild_meta_tensor")
METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
# LocalSerializedTensor's module before and from 0.5.20; the old one stops resolving (C-REFIT-TENSOR-LOCAL).
LOCAL_SERIALIZED_OLD = ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor")
LOCAL_SERIALIZED_NEW = (
    "sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"
)  # fmt: skip
LOAD_FORMATS = (None, "direct", "flattened_bucket")


class SchedulerError(Exception):
    """What SGLang's scheduler would raise on this push (it dies of it): exception type and message."""

    def __init__(self, exc_type: str, message: str) -> None:
        super().__init__(f"{exc_type}: {message}")
        self.exc_type, self.message = exc_type, message


class Unmodelled(Exception):
    """A push SGLang may accept but the emulator cannot read (answered success: false)."""


def allowed(major_minor_patch: tuple[int, int, int], module: str, name: str) -> str | None:
    """None when the version's SafeUnpickler resolves `module.name`, else the error it raises."""
    if major_minor_patch >= (0, 5, 21):
        if (module, name) in ALLOWED_GLOBALS:
            return None
        return f"Blocked unsafe global ({module}.{name}) during pickle deserialization"
    prefixes = ALLOWED_PREFIXES + tuple(
        p for since, added in ADDED_PREFIXES if major_minor_patch >= since for p in added
    )
    if (module, name) not in DENIED and any((module + ".").startswith(p) for p in prefixes):
        return None
    return f"Blocked unsafe class loading ({module}.{name}), to prevent exploitation of CVE-2025-10164"


def missing(major_minor_patch: tuple[int, int, int], module: str, name: str) -> str | None:
    """The AttributeError of `Unpickler.find_class` for a LocalSerializedTensor path the version lacks."""
    old_path = major_minor_patch < (0, 5, 20)
    if (module, name) == (LOCAL_SERIALIZED_NEW if old_path else LOCAL_SERIALIZED_OLD):
        return f"Can't get attribute '{name}' on <module '{module}'>"
    return None


# --- stand-ins (accounting backend) -----------------------------------------------------------------


@dataclass(frozen=True)
class DtypeRef:
    name: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.name]


@dataclass(frozen=True)
class ClassRef:
    module: str
    name: str

    def __call__(self, *args: Any) -> Any:
        raise Unmodelled(f"the emulator does not construct {self.module}.{self.name}")


@dataclass(frozen=True)
class TensorRef:
    """A tensor as its reduction describes it: enough to check what the receiver would do with it. `data`:
    its bytes, where the test world shared them (`--ipc-stand-in-dir`); `key` names it otherwise."""

    shape: tuple[int, ...]
    dtype: DtypeRef
    device: str  # "cuda:<index or uuid>" or "meta"
    storage_bytes: int
    data: bytes | None = None
    key: bytes = b""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class LocalSerialized:
    """Stands in for sglang's LocalSerializedTensor (a dataclass, `values: List[bytes]`, one per TP rank):
    NEWOBJ makes it, BUILD fills its __dict__."""

    values: Any


class Metadata:
    """Stands in for sglang's FlattenedTensorMetadata: NEWOBJ makes it, BUILD fills its __dict__."""

    name: Any
    shape: Any
    dtype: Any
    start_idx: Any
    end_idx: Any


def _size(dims: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in dims)


_ipc_dir: Path | None = None


def set_ipc_stand_in_dir(path: str | None) -> None:
    """Where the test world shares the bytes behind its stand-in IPC handles: a file per allocation, named
    by the handle's hex (rljob.testing.ipc_stand_in.share); the accounting backend's "opening" a handle."""
    global _ipc_dir
    _ipc_dir = Path(path) if path else None


def shared_bytes(
    handle: Any, storage_offset: int, storage_bytes: int, start: int, nbytes: int
) -> bytes | None:
    if _ipc_dir is None or not isinstance(handle, bytes):
        return None
    f = _ipc_dir / handle.hex()
    if not f.is_file():
        return None
    block = f.read_bytes()[storage_offset : storage_offset + storage_bytes]
    data = block[start : start + nbytes]
    return data if len(data) == nbytes else None


def _stand_in_cuda(*args: Any) -> TensorRef:
    if len(args) < 9:
        raise SchedulerError("TypeError", f"rebuild_cuda_tensor() takes 15 arguments ({len(args)} given)")
    size, dtype, device, storage_bytes = args[1], args[5], args[6], args[8]
    if not isinstance(dtype, DtypeRef):
        raise SchedulerError(
            "TypeError", f"rebuild_cuda_tensor(): dtype must be a torch.dtype, not {dtype!r}"
        )
    shape = _size(size)
    handle, offset = args[7], int(args[3]) * dtype.itemsize
    storage_offset = int(args[9]) if len(args) > 9 and isinstance(args[9], int) else 0
    nbytes = math.prod(shape) * dtype.itemsize
    data = shared_bytes(handle, storage_offset, int(storage_bytes), offset, nbytes)
    key = (
        handle if isinstance(handle, bytes) else repr(handle).encode()
    ) + f":{storage_offset}:{offset}".encode()
    return TensorRef(shape, dtype, f"cuda:{device}", int(storage_bytes), data, key)


def _stand_in_meta(*args: Any) -> TensorRef:
    if len(args) < 6:
        raise SchedulerError("TypeError", f"rebuild_meta_tensor() takes 7 arguments ({len(args)} given)")
    return TensorRef(_size(args[1]), args[4], "meta", int(args[5]))


def stand_in(module: str, name: str) -> Any:
    """What the accounting backend resolves an allowed global to (torch is not imported)."""
    if (module, name) == METADATA:
        return Metadata
    if (module, name) in (LOCAL_SERIALIZED_OLD, LOCAL_SERIALIZED_NEW):
        return LocalSerialized
    if (module, name) in REBUILD_CUDA:
        return _stand_in_cuda
    if (module, name) == REBUILD_META:
        return _stand_in_meta
    if (module, name) == ("torch", "Size"):
        return _size
    if module == "torch" and name in ITEMSIZE:
        return DtypeRef(name)
    if module in ("builtins", "collections", "copyreg"):
        return None  # the standard lookup
    return ClassRef(module, name)


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, data: bytes, version: tuple[int, int, int], resolve: Callable[[str, str], Any]
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._version, self._resolve = version, resolve

    def find_class(self, module: str, name: str) -> Any:
        refused = allowed(self._version, module, name)
        if refused is not None:
            raise SchedulerError("RuntimeError", refused)
        absent = missing(self._version, module, name)
        if absent is not None:
            raise SchedulerError("AttributeError", absent)
        found = self._resolve(module, name)
        return super().find_class(module, name) if found is None else found


def unpickle(data: bytes, version: tuple[int, int, int], resolve: Callable[[str, str], Any]) -> Any:
    try:
        return _Unpickler(data, version, resolve).load()
    except (SchedulerError, Unmodelled):
        raise
    except Exception as e:  # whatever pickle raises on a broken stream, SGLang raises too
        raise SchedulerError(type(e).__name__, str(e)) from e


# --- what the receiver does with the object -------------------------------------------------------


@dataclass
class Described:
    """A tensor reduced to what the checks need: shape, dtype name, element size, 1-D uint8 length."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int


def _describe(t: Any) -> Described | None:
    if isinstance(t, TensorRef):
        return Described(t.shape, t.dtype.name, t.dtype.itemsize)
    if type(t).__module__.startswith("torch") and hasattr(t, "element_size"):
        return Described(
            tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."), t.element_size()
        )
    return None


def _dtype_of(d: Any) -> tuple[str, int]:
    if isinstance(d, DtypeRef):
        return d.name, d.itemsize
    name = str(d).removeprefix("torch.")
    if type(d).__module__.startswith("torch") and name in ITEMSIZE:
        return name, ITEMSIZE[name]
    raise SchedulerError("TypeError", f"view(): argument 'dtype' must be torch.dtype, not {type(d).__name__}")


@dataclass
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    end: int


@dataclass
class Bucket:
    """One rank's push: the tensors it names and the device tensors whose bytes are loaded, in order."""

    entries: list[Entry]
    sources: list[Any]  # flattened_tensor, or each tensor of a (name, tensor) list
    nbytes: int
    flattened: bool = False  # entries are byte ranges of sources[0]; else entry i is sources[i]


Deserialize = Callable[[bytes], Any]


def local_tensor(value: LocalSerialized, rank: int, deserialize: Deserialize) -> Any:
    """`LocalSerializedTensor.get(tp_rank)` = `MultiprocessingSerializer.deserialize(values[tp_rank])`: a str
    is base64-decoded (validate=True), then the same restricted unpickler reads it (C-REFIT-TENSOR-LOCAL)."""
    try:
        data = value.values[rank]
    except AttributeError as e:
        no_values = "'LocalSerializedTensor' object has no attribute 'values'"
        raise SchedulerError("AttributeError", no_values) from e
    except IndexError as e:
        raise SchedulerError("IndexError", "list index out of range") from e
    except (TypeError, KeyError) as e:
        raise SchedulerError(type(e).__name__, str(e)) from e
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise SchedulerError("binascii.Error", str(e)) from e
    if not isinstance(data, bytes | bytearray):
        raise SchedulerError("TypeError", f"a bytes-like object is required, not '{type(data).__name__}'")
    return deserialize(bytes(data))


def read_push(
    obj: Any, load_format: str | None, unwrap: Callable[[LocalSerialized], Any] | None = None
) -> Bucket:
    """Check `obj` as the version's loader would use it (SchedulerError where it would raise). `unwrap`
    reads a LocalSerializedTensor's value for this rank (`local_tensor`)."""
    if load_format == "flattened_bucket":
        return _read_flattened(obj)
    bucket = _read_named_list(obj, unwrap)  # every tensor is unwrapped before load_format is looked at
    if load_format not in LOAD_FORMATS:
        raise SchedulerError("NotImplementedError", f"Unknown load_format={load_format}")
    return bucket


def _read_flattened(obj: Any) -> Bucket:
    if not isinstance(obj, dict):
        raise SchedulerError("TypeError", f"{type(obj).__name__} indices must be integers or slices, not str")
    for key in ("flattened_tensor", "metadata"):
        if key not in obj:
            raise SchedulerError("KeyError", repr(key))
    flat, flat_d = obj["flattened_tensor"], _describe(obj["flattened_tensor"])
    if flat_d is None:
        raise SchedulerError("AttributeError", f"'{type(flat).__name__}' object has no attribute 'view'")
    if len(flat_d.shape) != 1 or flat_d.dtype != "uint8":
        # SGLang slices by byte offsets: anything but a 1-D uint8 buffer loads wrong bytes or fails.
        raise Unmodelled(f"flattened_tensor of shape {list(flat_d.shape)} and dtype {flat_d.dtype}")
    length = flat_d.shape[0]
    entries = []
    for meta in obj["metadata"]:
        try:
            # every field is read into SGLang's own FlattenedTensorMetadata, numel too (C-REFIT-TENSOR-META)
            name, shape, dtype, start, end, _ = (
                meta.name, meta.shape, meta.dtype, int(meta.start_idx), int(meta.end_idx), meta.numel
            )  # fmt: skip
        except AttributeError as e:
            raise SchedulerError("AttributeError", str(e)) from e
        dname, itemsize = _dtype_of(dtype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise SchedulerError("RuntimeError", f"invalid shape dimension {min(shape)}")
        # flattened_tensor[start:end].view(dtype).reshape(shape), with Python's slice clamping
        lo, hi = min(max(start, 0), length), min(max(end, 0), length)
        got = max(0, hi - lo)
        where = f"to view {TORCH_TYPE_NAME['uint8']} as {TORCH_TYPE_NAME.get(dname, dname)}"
        if itemsize > 1 and lo % itemsize:
            raise SchedulerError(
                "RuntimeError",
                f"self.storage_offset() must be divisible by {itemsize} {where} (different element sizes), "
                f"but got {lo}",
            )
        if got % itemsize:
            raise SchedulerError(
                "RuntimeError",
                f"self.size(-1) must be divisible by {itemsize} {where} (different element sizes), "
                f"but got {got}",
            )
        if math.prod(shape) != got // itemsize:
            raise SchedulerError(
                "RuntimeError", f"shape '{list(shape)}' is invalid for input of size {got // itemsize}"
            )
        entries.append(Entry(str(name), shape, dname, lo, hi))
    return Bucket(entries, [flat], length, flattened=True)


PLAIN_TYPES = (type(None), bool, int, float, str, bytes, bytearray, list, tuple, dict, set, frozenset)


def _read_named_list(obj: Any, unwrap: Callable[[LocalSerialized], Any] | None) -> Bucket:
    if isinstance(obj, dict):
        raise SchedulerError("ValueError", "too many values to unpack (expected 2)")  # load_weights(dict)
    if not isinstance(obj, list | tuple):
        raise SchedulerError("TypeError", f"'{type(obj).__name__}' object is not iterable")
    entries, sources, offset = [], [], 0
    for item in obj:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise SchedulerError("ValueError", "not enough values to unpack (expected 2)")
        name, t = item
        if isinstance(t, LocalSerialized):
            if unwrap is None:
                raise Unmodelled(f"{name}: a LocalSerializedTensor with no rank to read it for")
            t = unwrap(t)
        d = _describe(t)
        if d is None and isinstance(t, PLAIN_TYPES):  # `_unwrap_tensor`: tensor.to(device)
            raise SchedulerError("AttributeError", f"'{type(t).__name__}' object has no attribute 'to'")
        if d is None:
            raise Unmodelled(f"{name}: {type(t).__name__} is not a tensor the emulator can read")
        n = math.prod(d.shape) * d.itemsize
        entries.append(Entry(str(name), d.shape, d.dtype, offset, offset + n))
        sources.append(t)
        offset += n
    return Bucket(entries, sources, offset)


# --- the GPU side (torch imported lazily) ---------------------------------------------------------

CHECKSUM_MULT, CHECKSUM_ADD = 0x9E3779B1, 0x7F4A7C15
CHECKSUM_MULT_HIGH, CHECKSUM_ADD_HIGH = 0x85EBCA77, 0x27D4EB2F
CHECKSUM_SLICE_WORDS = 16 << 20


def checksum_weights(k: Any) -> Any:
    """m_k for word positions k (an int64 tensor): ((lo * M + A) xor (hi * M' + A')) mod 2**31, made odd,
    with lo, hi the low and high 31 bits of k. Both halves count, so m has no period below 2**62 words
    (with lo alone, blocks 2**31 words = 8 GiB apart had equal weights and swapped unnoticed). Every
    product stays below 2**63: no overflow."""
    lo = ((k & 0x7FFFFFFF) * CHECKSUM_MULT + CHECKSUM_ADD) & 0x7FFFFFFF
    hi = (((k >> 31) & 0x7FFFFFFF) * CHECKSUM_MULT_HIGH + CHECKSUM_ADD_HIGH) & 0x7FFFFFFF
    return (lo ^ hi) | 1


def device_checksum(chunks: Sequence[Any]) -> str:
    """Checksum of the bytes of 1-D uint8 CUDA tensors taken as one stream, computed on their GPU:
    the stream is read as little-endian 32-bit words w_k (the last one zero-padded) and
    h = sum_k w_k * m_k mod 2**64 with m_k = `checksum_weights(k)` (odd: any change of one word changes h;
    position-dependent over the whole stream: moved words change it, however far apart). Returned as
    "wsum64:<16 hex digits>:<bytes>". Every chunk but the last must be a multiple of 4 bytes. Evidence that
    the bytes arrived, not a cryptographic hash; about 37 bytes of memory traffic per byte hashed."""
    import torch

    acc, pos, total = None, 0, 0
    for i, c in enumerate(chunks):
        n = int(c.numel())
        if n % 4 and i != len(chunks) - 1:
            raise ValueError(f"chunk {i} is {n} bytes: every chunk but the last must be a multiple of 4")
        whole = n - n % 4
        words = c[:whole].view(torch.int32) if whole else c[:0].view(torch.int32)
        parts = [words[s : s + CHECKSUM_SLICE_WORDS] for s in range(0, whole // 4, CHECKSUM_SLICE_WORDS)]
        if n % 4:
            tail = torch.zeros(4, dtype=torch.uint8, device=c.device)
            tail[: n % 4] = c[whole:]
            parts.append(tail.view(torch.int32))
        for p in parts:
            w = p.to(torch.int64) & 0xFFFFFFFF
            k = torch.arange(pos, pos + p.numel(), dtype=torch.int64, device=c.device)
            m = checksum_weights(k)
            part = (w * m).sum()
            acc = part if acc is None else acc + part
            pos += p.numel()
        total += n
    value = 0 if acc is None else int(acc.item()) & 0xFFFFFFFFFFFFFFFF
    return f"wsum64:{value:016x}:{total}"


@functools.cache
def _device_uuids() -> dict[str, int]:
    import torch

    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


class _CudaResolver:
    """Resolves globals to torch's own; the CUDA rebuild is timed (that is where the IPC handle opens)."""

    def __init__(self) -> None:
        import torch
        from torch.multiprocessing import reductions

        self._torch, self._reductions = torch, reductions
        self.open_seconds = 0.0
        self._uuids = _device_uuids()

    def _rebuild_cuda(self, *args: Any) -> Any:
        args_l = list(args)
        device = args_l[6]
        if isinstance(device, str):  # patch_torch._device_from_maybe_uuid
            if device not in self._uuids:
                raise SchedulerError("Exception", f"Invalid device_uuid={device}")
            args_l[6] = self._uuids[device]
        started = time.perf_counter()
        t = self._reductions.rebuild_cuda_tensor(*args_l)
        self.open_seconds += time.perf_counter() - started
        return t

    def __call__(self, module: str, name: str) -> Any:
        if (module, name) == METADATA:
            return Metadata
        if (module, name) in (LOCAL_SERIALIZED_OLD, LOCAL_SERIALIZED_NEW):
            return LocalSerialized
        if (module, name) in REBUILD_CUDA:
            return self._rebuild_cuda
        if module in ("builtins", "collections", "copyreg"):
            return None
        obj: Any = __import__(module, fromlist=[name])
        return getattr(obj, name)


class DeviceWeights(LoadedWeights):
    """Weights written into the GPU's weights region by tensor pushes. The checksum is computed on the
    GPU when first read; generation keys on the pushes' digest so that it never waits for it."""

    def __init__(self, push_digest: str, tensors: int, compute: Callable[[], str]) -> None:
        self._compute: Callable[[], str] | None = compute
        self._value: str | None = None
        self.push_digest = push_digest
        super().__init__("tensor", "<tensor>", "", tensors=tensors)

    @property  # type: ignore[override]
    def checksum(self) -> str:
        if self._value is None and self._compute is not None:
            self._value, self._compute = self._compute(), None
        return self._value or ""

    @checksum.setter
    def checksum(self, value: str) -> None:
        if value:
            self._value, self._compute = value, None

    @property
    def id(self) -> str:
        return self.push_digest if self.valid else "garbage"


class TensorRefit:
    """The tensor pushes of the refit in progress: digest, tensor count and (cuda) bytes written."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self._digest = hashlib.sha256()
        self._tensors = 0
        self._written = 0  # bytes of the weights region written by this refit's pushes (cuda)

    def apply(self, payloads: list[bytes], load_format: str | None, *, final: bool) -> str | None:
        """Read (and with the cuda backend load) one push; sets the engine's weights. Returns a failure
        message to answer with, or dies as SGLang's scheduler would."""
        eng = self.engine
        backend = eng.backend
        on_gpu = hasattr(backend, "write_weights")  # the cuda backend
        tp = eng.cfg.tp_size
        if len(payloads) < tp:  # serialized_named_tensors[tp_rank]
            fatal.scheduler_exception("IndexError", "list index out of range")
        kept = eng.faults.refit_noop or eng.faults.refit_loads_launch  # read as SGLang would; nothing lands
        try:
            if on_gpu and not kept:
                tensors, loaded = self._load_on_gpu(payloads[:tp], load_format)
            else:
                read = [self._check(p, rank, load_format) for rank, p in enumerate(payloads[:tp])]
                tensors, loaded = sum(len(r) for r in read) // tp, read[0]
        except SchedulerError as e:
            fatal.scheduler_exception(e.exc_type, e.message)
        except Unmodelled as e:
            return f"Failed to update weights: the emulator cannot read this push: {e}"
        if not eng.load_parameters(loaded, replace=False):
            return None  # a fault: the push answers success and the weights stay
        for p in payloads:
            self._digest.update(p)
        self._tensors += tensors
        digest = self._digest.hexdigest()
        if on_gpu and self._written:
            written = self._written
            backend.checksum_due(written)
            eng.weights = DeviceWeights(digest, self._tensors, lambda: backend.weights_checksum(written))
        else:
            eng.weights = LoadedWeights("tensor", "<tensor>", digest, tensors=self._tensors)
        if final:
            self.reset()
        return None

    def _check(self, data: bytes, rank: int, load_format: str | None) -> list[Loaded]:
        """One rank's push read with stand-ins: its tensors, with the bytes the test world shared."""
        version = self.engine.profile.key

        def deserialize(inner: bytes) -> Any:
            return unpickle(inner, version, stand_in)

        obj = deserialize(data)
        return _loaded(read_push(obj, load_format, lambda v: local_tensor(v, rank, deserialize)))

    def _load_on_gpu(self, payloads: list[bytes], load_format: str | None) -> tuple[int, list[Loaded]]:
        backend: Any = self.engine.backend
        started = time.perf_counter()
        decode_s = open_s = copy_s = close_s = 0.0
        offset, count, moved = self._written, 0, 0
        version = self.engine.profile.key
        loaded: list[Loaded] = []
        for rank, data in enumerate(payloads):
            resolver = _CudaResolver()

            def deserialize(inner: bytes, resolver: _CudaResolver = resolver) -> Any:
                return unpickle(inner, version, resolver)

            def unwrap(value: LocalSerialized, rank: int = rank, read: Deserialize = deserialize) -> Any:
                return local_tensor(value, rank, read)

            t0 = time.perf_counter()
            obj = deserialize(data)
            bucket = read_push(obj, load_format, unwrap)
            t1 = time.perf_counter()
            moved = max(moved, backend.write_weights(rank % backend.gpus, offset, bucket.sources))
            t2 = time.perf_counter()
            count = max(count, len(bucket.entries))
            if rank == 0:  # what the parameters hold: their bytes in the weights region (parameters.py)
                loaded = [
                    Loaded(e.name, e.shape, backend.weights_view(0, offset + e.start, offset + e.end))
                    for e in bucket.entries
                ]
            del obj, bucket  # drops the rebuilt tensors, closing the IPC handles (SGLang returns here)
            t3 = time.perf_counter()
            decode_s += t1 - t0 - resolver.open_seconds
            open_s += resolver.open_seconds
            copy_s += t2 - t1
            close_s += t3 - t2
        self._written = offset + moved
        backend.log_event(
            "tensor_push",
            "weights",
            time.perf_counter() - started,
            bytes=moved,
            offset=offset,
            ranks=len(payloads),
            decode_seconds=round(decode_s, 6),
            open_seconds=round(open_s, 6),
            copy_seconds=round(copy_s, 6),
            close_seconds=round(close_s, 6),
        )
        return count, loaded


def _loaded(bucket: Bucket) -> list[Loaded]:
    """The tensors of a push read with stand-ins: the bytes the test world shared behind their handles, or
    Unseen ones named by the handle (parameters.py)."""
    out = []
    for i, e in enumerate(bucket.entries):
        src = bucket.sources[0] if bucket.flattened else bucket.sources[i]
        lo, hi = (e.start, e.end) if bucket.flattened else (0, e.end - e.start)
        data = getattr(src, "data", None)
        key = getattr(src, "key", b"") + f"[{lo}:{hi}]".encode()
        out.append(Loaded(e.name, e.shape, data[lo:hi] if data is not None else Unseen(key)))
    return out
