"""Runs SGLang's own receive code on the payloads it is given, in a process whose sys.path holds one SGLang
version (hack/sglang-wheels.sh unpacks each into ~/.cache/rljob/sglang/<version>); used by
test_sglang_reads_payloads.py, one process per version.

    PYTHONPATH=~/.cache/rljob/sglang/0.5.23 python tests/unit/sglang_reader.py < job.json > result.json

job: {"uuid": GPU UUID the payloads name, "buckets": [{"wire": base64 pickle, "buffers": {hex handle:
base64 bytes of the allocation}}], "refused": [base64 pickle, ...]}. For each bucket, as SGLang's
scheduler does: `monkey_patch_torch_reductions()` (device UUID -> index), then
`MultiprocessingSerializer.deserialize` (its SafeUnpickler), then `FlattenedTensorBucket(...)
.reconstruct_tensors()`. Only opening the CUDA IPC handle is stood in for (no GPU here): torch's
`rebuild_cuda_tensor`, under SGLang's patch, gets the allocation's bytes from `buffers` by handle and
rebuilds the tensor with the pickled size, stride and offset on the CPU. result: the version, and per
bucket each tensor's name, dtype, shape and the sha256 of its bytes; per refused payload, the error.
With "requests": [{"path", "body"}] (the agent's request bodies), each is bound as SGLang's server binds it
(`read_requests`)."""

from __future__ import annotations

import ast
import base64
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def main() -> None:
    job = json.load(sys.stdin)
    import sglang
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from torch.multiprocessing import reductions

    buffers: dict[bytes, bytes] = {}
    devices: list[Any] = []

    def open_ipc_handle(*args: Any) -> Any:
        """torch's rebuild_cuda_tensor signature; the device has already gone through SGLang's patch."""
        (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size, storage_offset) = (
            args[:10]
        )
        devices.append(device)
        block = buffers[bytes(handle)]  # the whole allocation the handle names
        if len(block) < storage_offset + storage_size:
            raise ValueError(
                f"the allocation is {len(block)} bytes, the storage ends at {storage_offset + storage_size}"
            )
        # The storage starts storage_offset bytes into the allocation; the tensor `offset` elements into it.
        storage = torch.frombuffer(
            bytearray(block[storage_offset : storage_offset + storage_size]), dtype=torch.uint8
        )
        return storage.view(dtype).as_strided(tuple(size), tuple(stride), offset)

    monkey_patch_torch_reductions()
    reductions._rebuild_cuda_tensor_original = open_ipc_handle
    # One GPU whose UUID is the one the trainer named (SGLang maps it back to an index).
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_properties = lambda _index: SimpleNamespace(uuid=job["uuid"])

    result: dict[str, Any] = {"version": sglang.__version__, "buckets": [], "refused": []}
    for bucket in job["buckets"]:
        buffers.update({bytes.fromhex(h): base64.b64decode(b) for h, b in bucket["buffers"].items()})
        obj = MultiprocessingSerializer.deserialize(bucket["wire"])
        flat = obj["flattened_tensor"]
        tensors = FlattenedTensorBucket(flattened_tensor=flat, metadata=obj["metadata"]).reconstruct_tensors()
        result["buckets"].append(
            {
                "flattened": [str(flat.dtype), list(flat.shape)],
                "metadata_class": sorted(
                    {f"{type(m).__module__}.{type(m).__name__}" for m in obj["metadata"]}
                ),
                "tensors": [
                    [name, str(t.dtype).removeprefix("torch."), list(t.shape), _sha256(t)]
                    for name, t in tensors
                ],
            }
        )
    result["devices"] = devices
    for wire in job["refused"]:
        try:
            MultiprocessingSerializer.deserialize(wire)
            result["refused"].append(None)
        except Exception as e:
            result["refused"].append(f"{type(e).__name__}: {e}")
    if job.get("requests"):
        result["read_requests"] = read_requests(job["requests"], Path(sglang.__file__).parent)
    json.dump(result, sys.stdout)


def route_classes(http_server: Path, io_struct: Any) -> dict[str, str | None]:
    """Route path -> the io_struct class its handler's parameters bind the JSON body to (None: the handler
    takes none), read from SGLang's own http_server.py."""
    routes: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = [
            d.args[0].value
            for d in node.decorator_list
            if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
        ]
        names = [
            n.id
            for a in node.args.args
            if a.annotation is not None
            for n in ast.walk(a.annotation)
            if isinstance(n, ast.Name) and _fields(getattr(io_struct, n.id, None)) is not None
        ]
        for path in paths:
            routes[str(path)] = names[0] if names else None
    return routes


def read_requests(requests: list[dict[str, Any]], root: Path) -> list[dict[str, Any]]:
    """Each request body as SGLang's server binds it: the route's io_struct class built from the body (a
    key it has no field for is an error here) and validated by pydantic as FastAPI validates the body
    parameter (with the class's own pydantic schema where it has one; a wrong type: 422)."""
    import pydantic
    from sglang.srt.managers import io_struct

    routes = route_classes(root / "srt/entrypoints/http_server.py", io_struct)
    out = []
    for req in requests:
        entry: dict[str, Any] = {"path": req["path"], "routed": req["path"] in routes, "class": None}
        name = routes.get(req["path"])
        if name is not None:
            cls = getattr(io_struct, name)
            entry["class"] = name
            entry["fields"] = sorted(_fields(cls) or ())
            entry["init"] = _error_of(cls, **req["body"])
            entry["validated"] = _error_of(pydantic.TypeAdapter(cls).validate_python, req["body"])
        out.append(entry)
    return out


def _fields(cls: Any) -> tuple[str, ...] | None:
    """The fields of an io_struct request class: a dataclass (up to 0.5.15) or a msgspec Struct (later,
    bound through its own pydantic schema); None for anything else."""
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    struct_fields = getattr(cls, "__struct_fields__", None) if isinstance(cls, type) else None
    return tuple(struct_fields) if struct_fields is not None else None


def _error_of(call: Any, *args: Any, **kwargs: Any) -> str | None:
    try:
        call(*args, **kwargs)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _sha256(t: Any) -> str:
    """Of the tensor's bytes in memory order (any dtype, also 0-d and empty)."""
    import torch

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    main()
