"""The IPC handles of a weight push, read the way vLLM's worker reads them and written back, without
running them: every global the pickle names is a stand-in, so nothing in it executes (V-REFIT-IPC).

vLLM's handle of a packed buffer is `{gpu_uuid: rebuild_cuda_tensor args}` (ipc:72-132@0.26.0); each
worker opens the entry of its own GPU. SkyRL's worker extension takes `{gpu_uuid: reduce_tensor(t)}`
instead, the rebuild function and its args (docs/vllm-conformance.md §11): `native` rewrites that form
into vLLM's (a pickle that loads to the same objects)."""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

REBUILD_ARGS = 15  # rebuild_cuda_tensor's arguments, as reduce_tensor gives them (torch 2.x)
STORAGE_BYTES_ARG = 8  # the storage's size in bytes among them


@dataclass(frozen=True)
class Global:
    """A global the pickle names (a class, a function, a dtype): never imported."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Reduced:
        return Reduced(self, args)


@dataclass(frozen=True)
class Reduced:
    """An object the pickle builds by calling a global (torch.Size((2, 3)), say)."""

    func: Global
    args: tuple[Any, ...]


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return Global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id: not a handle vLLM reads")


def decode(text: Any) -> tuple[Any, str | None]:
    """`ipc_handles_pickled` read as vLLM reads it (base64, then a pickle): (the object with stand-ins,
    None), or (None, why vLLM could not read it)."""
    if not isinstance(text, str):
        return None, f"not a string but {type(text).__name__}"
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        return None, f"not base64 ({e})"
    try:
        return _Reader(io.BytesIO(raw)).load(), None
    except Exception as e:  # any failure here is one vLLM's pickle.loads raises
        return None, f"not a pickle vLLM can read ({type(e).__name__}: {str(e)[:120]})"


def rebuild_args(entry: Any) -> tuple[Any, ...] | None:
    """An entry of a handle dict as vLLM's worker uses it (`list(args)`, then args[6] replaced): the
    rebuild args, or None when the entry is not that."""
    if isinstance(entry, tuple) and len(entry) == REBUILD_ARGS:
        return entry
    return None


def storage_bytes(args: tuple[Any, ...]) -> int | None:
    value = args[STORAGE_BYTES_ARG]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1}
TORCH_SIZE = Global("torch", "Size")
UINT8 = Global("torch", "uint8")


def byte_view(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The same contiguous 1-D buffer's rebuild args, viewed as uint8 (what vLLM's packed consumer splits
    by byte sizes, packed_tensor.py:377-430@0.26.0): size and offset in bytes, stride 1. None when the
    args are not a contiguous 1-D tensor of a known dtype."""
    dtype, size, stride, offset = args[5], args[1], args[2], args[3]
    if not isinstance(dtype, Global) or dtype.module != "torch" or dtype.name not in ITEMSIZE:
        return None
    if not isinstance(size, Reduced) or size.func != TORCH_SIZE or len(size.args) != 1:
        return None
    dims = size.args[0]
    if not (isinstance(dims, tuple) and len(dims) == 1 and isinstance(dims[0], int)) or stride != (1,):
        return None
    if not isinstance(offset, int):
        return None
    item = ITEMSIZE[dtype.name]
    out = list(args)
    out[1] = Reduced(TORCH_SIZE, ((dims[0] * item,),))
    out[3] = offset * item
    out[5] = UINT8
    return tuple(out)


def native(handles: Any) -> dict[str, tuple[Any, ...]] | None:
    """`{uuid: args}` from vLLM's form or from SkyRL's `{uuid: (rebuild_cuda_tensor, args)}`; None when
    `handles` is neither."""
    if not isinstance(handles, dict) or not handles:
        return None
    out: dict[str, tuple[Any, ...]] = {}
    for uuid, entry in handles.items():
        if not isinstance(uuid, str):
            return None
        args = rebuild_args(entry)
        if args is None and isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], Global):
            args = rebuild_args(entry[1])
        if args is None:
            return None
        out[uuid] = args
    return out


def encode(obj: Any) -> str:
    """base64 of a protocol-4 pickle of `obj` (None, bool, int, float, str, bytes, tuple, list, dict,
    Global, Reduced): what `pickle.dumps` writes for the objects they stand for."""
    out: list[bytes] = [b"\x80\x04"]
    _write(obj, out)
    out.append(b".")
    return base64.b64encode(b"".join(out)).decode("ascii")


def _write(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"N")
    elif obj is True or obj is False:
        out.append(b"\x88" if obj else b"\x89")
    elif isinstance(obj, int):
        if 0 <= obj < 256:
            out += [b"K", bytes([obj])]
        elif -(1 << 31) <= obj < (1 << 31):
            out += [b"J", struct.pack("<i", obj)]
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            out += [b"\x8a", bytes([len(raw)]), raw]
    elif isinstance(obj, float):
        out += [b"G", struct.pack(">d", obj)]
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        out += (
            [b"\x8c", bytes([len(raw)]), raw] if len(raw) < 256 else [b"X", struct.pack("<I", len(raw)), raw]
        )
    elif isinstance(obj, bytes):
        out += [b"C", bytes([len(obj)]), obj] if len(obj) < 256 else [b"B", struct.pack("<I", len(obj)), obj]
    elif isinstance(obj, tuple):
        if not obj:
            out.append(b")")
        elif len(obj) <= 3:
            for x in obj:
                _write(x, out)
            out.append({1: b"\x85", 2: b"\x86", 3: b"\x87"}[len(obj)])
        else:
            out.append(b"(")
            for x in obj:
                _write(x, out)
            out.append(b"t")
    elif isinstance(obj, list):
        out.append(b"]")
        if obj:
            out.append(b"(")
            for x in obj:
                _write(x, out)
            out.append(b"e")
    elif isinstance(obj, dict):
        out.append(b"}")
        if obj:
            out.append(b"(")
            for k, v in obj.items():
                _write(k, out)
                _write(v, out)
            out.append(b"u")
    elif isinstance(obj, Global):
        _write(obj.module, out)
        _write(obj.name, out)
        out.append(b"\x93")  # STACK_GLOBAL
    elif isinstance(obj, Reduced):
        _write(obj.func, out)
        _write(obj.args, out)
        out.append(b"R")
    else:
        raise TypeError(f"cannot write {type(obj).__name__} into a handle pickle")
