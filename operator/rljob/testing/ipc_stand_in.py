"""A stand-in for torch's CUDA IPC reduction of a tensor, written without torch or a GPU: what
`torch.multiprocessing.reductions.reduce_tensor` returns for a CUDA tensor (`rebuild_cuda_tensor` and its 15
arguments) with made-up handles. tests/unit/test_packing.py checks the argument types against a real CUDA
reduction; SGLang's unpickler and the emulator read it as they read a real one (they open no handle here).

`share` stands in for the allocation a handle names: the bytes go to a file named by the handle's hex in a
directory the emulator is given (`--ipc-stand-in-dir`), where it reads them as SGLang reads the memory behind
a real handle; so the weights the emulator then holds are the pushed tensors' bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rljob.trainer.engines.sglang.packing import TORCH_SIZE, Call, Global

ITEMSIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4, "int64": 8}
UUID = "GPU-00000000-0000-0000-0000-000000000000"


def cuda_reduction(
    nbytes: int,
    *,
    dtype: str = "uint8",
    shape: Sequence[int] | None = None,
    device: str = UUID,
    handle: bytes = b"\x07" * 64,
    storage_bytes: int | None = None,
    storage_offset: int = 0,
    ref_counter: bytes = b"/torch_1_2",
    event: bytes = b"\x01" * 64,
) -> Call:
    """A contiguous CUDA tensor of `nbytes` (1-D of `dtype` unless `shape` is given) in a storage of
    `storage_bytes` (default `nbytes`) at `storage_offset`, on `device` (an index's UUID, as SGLang's
    patched reduction sends it, or "GPU-<index>")."""
    dims = tuple(shape) if shape is not None else (nbytes // ITEMSIZE[dtype],)
    strides: list[int] = []
    step = 1
    for d in reversed(dims):
        strides.insert(0, step)
        step *= d
    return Call(
        Global("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        (
            Global("torch", "Tensor"),
            Call(TORCH_SIZE, (dims,)),
            tuple(strides),
            0,
            Global("torch.storage", "TypedStorage"),
            Global("torch", dtype),
            device,
            handle,
            nbytes if storage_bytes is None else storage_bytes,
            storage_offset,
            False,
            ref_counter,
            0,
            event,
            True,
        ),
    )


def share(data: bytes, directory: Path, *, dtype: str = "uint8", shape: Sequence[int] | None = None) -> Call:
    """The reduction of a CUDA tensor holding `data` (1-D uint8 unless `dtype`/`shape` say otherwise), its
    handle naming a file of `directory` that holds the bytes (written once; the handle is their sha256)."""
    handle = hashlib.sha256(data).digest() * 2
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / handle.hex()
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return cuda_reduction(len(data), dtype=dtype, shape=shape, handle=handle)


def vllm_update(
    arrays: dict[str, np.ndarray], shared: Path | None = None, uuid: str = UUID
) -> dict[str, Any]:
    """`arrays` (one dtype) as one packed bucket of vLLM's IPC weight transfer (rljob.trainer.engines.vllm
    .packing): their bytes back to back in one stand-in buffer on GPU `uuid`, shared in `shared` where
    given (the emulator then holds them as pushed), else a handle named by their sha256."""
    from rljob.trainer.engines.sglang import packing as stand_in_pickle
    from rljob.trainer.engines.vllm import packing

    data = b"".join(a.tobytes() for a in arrays.values())
    if shared is not None:
        reduction = share(data, shared)
    else:
        digest = hashlib.sha256(data).digest()
        reduction = cuda_reduction(len(data), handle=digest * 2, event=digest * 2)
    handles = {uuid: reduction.args}
    return packing.update_info(
        list(arrays),
        [str(a.dtype) for a in arrays.values()],
        [list(a.shape) for a in arrays.values()],
        [int(a.nbytes) for a in arrays.values()],
        stand_in_pickle.to_wire(stand_in_pickle.dumps(handles)),
    )
