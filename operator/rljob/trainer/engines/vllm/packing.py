"""The trainer's tensors as vLLM's IPC weight transfer reads them (V-REFIT-IPC in docs/vllm-conformance.md):
each bucket one flat uint8 CUDA buffer, tensors back to back in input order, one dtype per bucket (a slice
is viewed as its dtype), and its `update_info`:

    {"names": [...], "dtype_names": ["bfloat16", ...], "shapes": [[...], ...],
     "tensor_sizes": [bytes of each tensor], "ipc_handles_pickled": base64(pickle({gpu_uuid: args}))}

`args` is what `torch.multiprocessing.reductions.reduce_tensor(buffer)` returns after the rebuild function,
which vLLM's `packed_ipc_consumer` rebuilds on each worker's own GPU (found by UUID: the two containers may
number the GPUs differently; …/distributed/weight_transfer/packed_tensor.py:377-430@0.26.0,
ipc:72-132@0.26.0). Whether the buffer is packed is the agent's to tell vLLM (0.26 reads `packed` in the
update, 0.34 at the transfer's init): the SDK sends no `packed`. vLLM unpickles the handles only with
VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its environment (V-REFIT-IPC-INSECURE).

A buffer stays referenced until vLLM answered its push (it clones what it loads from it,
packed_tensor.py:391-397@0.26.0), so a bucket's memory is free to reuse once its push returned."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_BUCKET_BYTES = 2 << 30


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 -> "bfloat16" (vLLM does `getattr(torch, name)`)."""
    return str(dtype).removeprefix("torch.")


def update_info(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    tensor_sizes: Sequence[int],
    ipc_handles_pickled: str,
) -> dict[str, Any]:
    """One packed bucket's update, as the agent forwards it to `/update_weights`."""
    return {
        "names": list(names),
        "dtype_names": list(dtype_names),
        "shapes": [list(s) for s in shapes],
        "tensor_sizes": list(tensor_sizes),
        "ipc_handles_pickled": ipc_handles_pickled,
    }


def handles_pickled(handles: dict[str, Any]) -> str:
    """base64(pickle({gpu_uuid: rebuild args})): how vLLM's HTTP sender writes them (ipc:487-496@0.26.0)."""
    return base64.b64encode(pickle.dumps(handles)).decode("utf-8")


@dataclass
class Bucket:
    """One packed buffer and its update; `buffer` must stay referenced until vLLM answered the push."""

    info: dict[str, Any]
    buffer: Any
    nbytes: int


def _plan(named: list[tuple[str, Any]], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """Tensors in input order, a new bucket at a dtype or device change or when the next would overflow."""
    out: list[list[tuple[str, Any]]] = []
    size = 0
    for name, t in named:
        nbytes = int(t.numel()) * int(t.element_size())
        last = out[-1] if out else None
        fits = last is not None and size + nbytes <= bucket_bytes
        same = last is not None and last[0][1].dtype == t.dtype and last[0][1].device == t.device
        if not (fits and same):
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out


def buckets(
    named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[Bucket]:
    """CUDA tensors packed bucket by bucket (each built when the previous was taken: at most the bucket
    being sent and the next are allocated). Needs torch (imported here only)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    named = [(n, t.detach()) for n, t in named_tensors]
    for group in _plan(named, bucket_bytes):
        device = group[0][1].device
        total = sum(int(t.numel()) * int(t.element_size()) for _, t in group)
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        offset = 0
        sizes = []
        for _, t in group:
            n = int(t.numel()) * int(t.element_size())
            buffer[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
            sizes.append(n)
            offset += n
        torch.cuda.synchronize(device)
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        _, args = reduce_tensor(buffer)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        info = update_info(
            [n for n, _ in group],
            [dtype_name(t.dtype) for _, t in group],
            [list(t.shape) for _, t in group],
            sizes,
            handles_pickled({uuid: args}),
        )
        yield Bucket(info, buffer, total)
