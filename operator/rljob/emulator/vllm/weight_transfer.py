"""vLLM's native weight transfer as one worker reads it (V-ROUTE-WT-*, V-REFIT-IPC, V-REFIT-IPC-INSECURE,
V-REFIT-NCCL in docs/vllm-conformance.md): the init and update infos built as the backend's dataclasses
(a missing or unknown field is the dataclass's TypeError, turned into "Invalid … for …Engine: …"), the
`ipc_handles_pickled` gate, and the CUDA IPC handles.

The handles are what `torch.multiprocessing.reductions.reduce_tensor` returns (its 15 rebuild arguments)
keyed by GPU UUID. Without a GPU (the accounting backend) the pickle is read with stand-ins for torch's
classes and dtypes (`rljob.emulator.tensor_refit.stand_in`, the SGLang emulator's), so names, UUIDs,
dtypes, shapes and byte sizes are checked as the worker would use them and the weights' evidence is a
digest of the push; no handle is opened. With the cuda backend the handles are opened with torch and the
bytes copied into the weights region. An NCCL update carries no bytes here: its metadata stands in for the
broadcast (as the SGLang emulator's distributed refit does)."""

from __future__ import annotations

import base64
import hashlib
import io
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rljob.emulator.tensor_refit import ITEMSIZE, DtypeRef, shared_bytes, stand_in

TORCH_TYPE_NAME = {"uint8": "Byte", "bfloat16": "BFloat16", "float16": "Half", "float32": "Float"}
REBUILD_ARGS = 15  # torch.multiprocessing.reductions.rebuild_cuda_tensor's parameters


def construct(
    cls_name: str, given: dict[str, Any], required: Sequence[str], optional: dict[str, Any], *, kw_only: bool
) -> dict[str, Any]:
    """A dataclass `cls_name(**given)`: TypeError with Python's own message for an unknown or missing
    field; the fields with defaults filled in."""
    for key in given:
        if key not in required and key not in optional:
            raise TypeError(f"{cls_name}.__init__() got an unexpected keyword argument '{key}'")
    missing = [f for f in required if f not in given]
    if missing:
        kind = "keyword-only" if kw_only else "positional"
        quoted = [f"'{m}'" for m in missing]
        names = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + f" and {quoted[-1]}"
        plural = "argument" if len(missing) == 1 else "arguments"
        raise TypeError(f"{cls_name}.__init__() missing {len(missing)} required {kind} {plural}: {names}")
    return {**optional, **given}


MODULES = {
    "IPCWeightTransferInitInfo": "vllm.distributed.weight_transfer.ipc_engine",
    "IPCWeightTransferUpdateInfo": "vllm.distributed.weight_transfer.ipc_engine",
    "NCCLWeightTransferInitInfo": "vllm.distributed.weight_transfer.nccl_common",
    "NCCLWeightTransferUpdateInfo": "vllm.distributed.weight_transfer.nccl_engine",
}


def not_a_mapping(kind: str, engine_cls: str, info_cls: str, value: Any) -> ValueError:
    """`info_cls(**value)` for a value that is not a dict, as parse_*_info reports it."""
    return ValueError(
        f"Invalid {kind} for {engine_cls}: {MODULES[info_cls]}.{info_cls}() argument after ** must be a "
        f"mapping, not {type(value).__name__}"
    )


def parse(kind: str, engine_cls: str, info_cls: str, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`parse_init_info` / `parse_update_info`: the dataclass's TypeError becomes a ValueError
    (wtb:217-256@0.26.0, wtb:517-556@0.34.0)."""
    try:
        return build()
    except TypeError as e:
        raise ValueError(f"Invalid {kind} for {engine_cls}: {e}") from e


def _same_length(info: dict[str, Any]) -> None:
    """The update infos' __post_init__ checks (ipc:72-132@0.26.0, ncce:84-96@0.26.0: __post_init__)."""
    names = info["names"]
    n = len(names)
    if len(info["dtype_names"]) != n:
        raise ValueError(
            f"`dtype_names` should be of the same size as `names`: got {len(info['dtype_names'])} and {n}"
        )
    if len(info["shapes"]) != n:
        raise ValueError(f"`shapes` should be of the same size as `names`: got {len(info['shapes'])} and {n}")


# --- IPC -------------------------------------------------------------------------------------------


def _unpickle_handles(info: dict[str, Any], insecure_ok: bool, loads: Callable[[bytes], Any]) -> bytes | None:
    """`ipc_handles_pickled` -> `ipc_handles`, only with VLLM_ALLOW_INSECURE_SERIALIZATION=1; the pickle."""
    pickled = info.pop("ipc_handles_pickled", None)
    if pickled is None:
        return None
    if info.get("ipc_handles") is not None:
        raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
    if not insecure_ok:
        raise ValueError(
            "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
        )
    raw = base64.b64decode(pickled)
    info["ipc_handles"] = loads(raw)
    return raw


def ipc_update_info(
    given: dict[str, Any], *, packed_field: bool, insecure_ok: bool, loads: Callable[[bytes], Any]
) -> dict[str, Any]:
    """IPCWeightTransferUpdateInfo(**given) and its checks (V-REFIT-IPC, V-REFIT-IPC-INSECURE). 0.26
    (`packed_field`) unpickles the handles in parse_update_info, before the dataclass is built
    (ipc:168-196@0.26.0); 0.34 in its __post_init__, after (ipc:72-93@0.34.0)."""
    given = dict(given)
    optional: dict[str, Any] = {"ipc_handles": None, "ipc_handles_pickled": None, "tensor_sizes": None}
    if packed_field:
        optional["packed"] = False
    raw = _unpickle_handles(given, insecure_ok, loads) if packed_field else None

    def build() -> dict[str, Any]:
        return construct(
            "IPCWeightTransferUpdateInfo", given, ("names", "dtype_names", "shapes"), optional, kw_only=False
        )

    info = parse("update_info", "IPCWeightTransferEngine", "IPCWeightTransferUpdateInfo", build)
    raw = raw or _unpickle_handles(info, insecure_ok, loads)
    info["_digest_source"] = raw  # what the accounting backend's evidence is computed over
    if info["ipc_handles"] is None:
        raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
    _same_length(info)
    handles = info["ipc_handles"]
    n = len(info["names"])
    if not info.get("packed") and isinstance(handles, list) and len(handles) != n:
        raise ValueError(f"`ipc_handles` should be of the same size as `names`: got {len(handles)} and {n}")
    if packed_field and info["packed"] and info["tensor_sizes"] is None:
        raise ValueError("`tensor_sizes` is required when packed=True")
    return info


class _StandInUnpickler(pickle.Unpickler):
    """pickle.loads as vLLM calls it, with torch's globals resolved to stand-ins (no torch here)."""

    def find_class(self, module: str, name: str) -> Any:
        found = stand_in(module, name)
        return super().find_class(module, name) if found is None else found


def loads_without_torch(raw: bytes) -> Any:
    """`pickle.loads(raw)` with stand-ins; a global the emulator cannot stand in for is Unmodelled."""
    return _StandInUnpickler(io.BytesIO(raw)).load()


@dataclass(frozen=True)
class Rebuilt:
    """A tensor rebuilt from its IPC handle, reduced to what loading checks."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    tensor: Any = None  # the torch tensor (cuda backend)


def rebuild(args: Any, open_handle: Callable[[list[Any]], Any] | None) -> Rebuilt:
    """`rebuild_cuda_tensor(*list_args)` with args[6] already the receiver's device index."""
    list_args = list(args) if isinstance(args, list | tuple) else None
    if list_args is None:
        raise TypeError(f"'{type(args).__name__}' object is not iterable")
    if len(list_args) != REBUILD_ARGS:
        given = len(list_args)
        raise TypeError(
            f"rebuild_cuda_tensor() takes {REBUILD_ARGS} positional arguments but {given} were given"
        )
    if open_handle is not None:
        t = open_handle(list_args)
        dtype = str(t.dtype).removeprefix("torch.")
        return Rebuilt(tuple(int(d) for d in t.shape), dtype, int(t.numel()) * t.element_size(), t)
    shape, dtype = list_args[1], list_args[5]
    if not isinstance(dtype, DtypeRef):
        raise TypeError(f"rebuild_cuda_tensor(): dtype must be a torch.dtype, not {type(dtype).__name__}")
    dims = tuple(int(d) for d in shape)
    return Rebuilt(dims, dtype.name, math.prod(dims) * dtype.itemsize)


def handle_bytes(args: Any, nbytes: int) -> bytes | None:
    """The bytes behind a stand-in handle's `nbytes`, where the test world shared them
    (--ipc-stand-in-dir, rljob.testing.ipc_stand_in.share); None where it did not."""
    if not isinstance(args, list | tuple) or len(args) != REBUILD_ARGS or not isinstance(args[5], DtypeRef):
        return None
    offset = int(args[3]) * args[5].itemsize if isinstance(args[3], int) else 0
    storage_offset = int(args[9]) if isinstance(args[9], int) else 0
    storage = int(args[8]) if isinstance(args[8], int) else 0
    return shared_bytes(args[7], storage_offset, storage, offset, nbytes)


def own_handle(handle: Any, uuid: str) -> Any:
    """Each worker takes its own GPU's entry (ipc:255-272@0.26.0)."""
    if not isinstance(handle, dict) or uuid not in handle:
        available = list(handle.keys()) if isinstance(handle, dict) else []
        raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {available}")
    return handle[uuid]


def _torch_dtype(name: Any) -> tuple[str, int]:
    """`getattr(torch, dn)` for a dtype name."""
    if not isinstance(name, str) or name not in ITEMSIZE:
        raise AttributeError(f"module 'torch' has no attribute '{name}'")
    return name, ITEMSIZE[name]


def unpack(
    buffer: Rebuilt, names: list[str], shapes: list[Any], dtype_names: list[Any], sizes: list[Any]
) -> list[tuple[str, Rebuilt]]:
    """packed_ipc_consumer: the buffer cut to sum(tensor_sizes) of its elements, split by `tensor_sizes`,
    each piece viewed as its dtype and shape (…/distributed/weight_transfer/packed_tensor.py:19-46,377-430
    @0.26.0). The sizes are bytes of a uint8 buffer, as vLLM's producer packs it; a buffer of another dtype
    is cut and split in its own elements, as torch does."""
    dtypes = [_torch_dtype(d) for d in dtype_names]
    sizes_i = [int(s) for s in sizes]
    item = ITEMSIZE.get(buffer.dtype, 1)
    content = min(sum(sizes_i), buffer.nbytes // item)
    if sum(sizes_i) != content:
        raise RuntimeError(
            f"split_with_sizes expects split_sizes to sum exactly to {content} (input tensor's size at "
            f"dimension 0), but got split_sizes={sizes_i}"
        )
    out: list[tuple[str, Rebuilt]] = []
    for name, shape, (dname, itemsize), size in zip(names, shapes, dtypes, sizes_i, strict=False):
        nbytes = size * item
        if nbytes % itemsize:
            raise RuntimeError(
                f"self.size(-1) must be divisible by {itemsize} to view Byte as "
                f"{TORCH_TYPE_NAME.get(dname, dname)} (different element sizes), but got {size}"
            )
        dims = tuple(int(d) for d in shape)
        if math.prod(dims) != nbytes // itemsize:
            raise RuntimeError(f"shape '{list(dims)}' is invalid for input of size {nbytes // itemsize}")
        out.append((str(name), Rebuilt(dims, dname, nbytes)))
    return out


def torch_size(dims: Sequence[int]) -> str:
    return f"torch.Size({list(dims)})"


def load_weights(weights: list[tuple[str, Rebuilt]], params: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """`model.load_weights`: against the launch checkpoint's tensors when it has any (an unknown name is
    the params dict's KeyError; a wrong shape default_weight_loader's assert). Without them any name is
    taken."""
    if not params:
        return
    for name, t in weights:
        if name not in params:
            raise KeyError(name)
        _, shape = params[name]
        if tuple(shape) != t.shape:
            raise AssertionError(
                f"Attempted to load weight ({torch_size(t.shape)}) into parameter ({torch_size(shape)})"
            )


def push_digest(info: dict[str, Any]) -> bytes:
    """What the accounting backend keys the pushed weights on: the update's metadata and handle bytes."""
    h = hashlib.sha256()
    for key in ("names", "dtype_names", "shapes", "tensor_sizes"):
        h.update(repr(info.get(key)).encode())
    raw = info.get("_digest_source")
    h.update(raw if isinstance(raw, bytes) else repr(info.get("ipc_handles")).encode())
    return h.digest()


# --- NCCL ------------------------------------------------------------------------------------------


def nccl_update_info(given: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    def build() -> dict[str, Any]:
        return construct(
            "NCCLWeightTransferUpdateInfo", given, ("names", "dtype_names", "shapes"), optional, kw_only=False
        )

    info = parse("update_info", "NCCLWeightTransferEngine", "NCCLWeightTransferUpdateInfo", build)
    _same_length(info)
    return info


def nccl_rendezvous_mode(info: dict[str, Any]) -> None:
    """decode_nccl_unique_id (nccom:37-70@0.34.0): exactly one rendezvous mode."""
    uid, addr, port = info.get("nccl_unique_id_b64"), info.get("master_address"), info.get("master_port")
    ctx = "NCCLWeightTransferInitInfo"
    if uid and (addr is not None or port is not None):
        raise ValueError(f"{ctx}: pass nccl_unique_id_b64 OR master_address/master_port, not both")
    if not uid and (addr is None or port is None):
        raise ValueError(
            f"{ctx}: need nccl_unique_id_b64, or both master_address and master_port "
            f"(got master_address={addr!r}, master_port={port!r})"
        )
