"""The emulator's reader of tensor pushes (rljob.emulator.tensor_refit) against what each SGLang version's
unpickler and loader do: LocalSerializedTensor payloads (C-REFIT-TENSOR-LOCAL), payloads that are not a
pickle (C-REFIT-TENSOR-PICKLE), the module-prefix allowlist by version. No torch: the accounting backend's
stand-ins."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.emulator.tensor_refit import (
    LOCAL_SERIALIZED_NEW,
    LOCAL_SERIALIZED_OLD,
    SchedulerError,
    Unmodelled,
    allowed,
    local_tensor,
    read_push,
    stand_in,
    unpickle,
)
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.packing import TORCH_SIZE, Call, Global, Instance, dumps

V0_5_6, V0_5_15, V0_5_20, V0_5_21, V0_5_23 = (0, 5, 6), (0, 5, 15), (0, 5, 20), (0, 5, 21), (0, 5, 23)
VERSIONS = (V0_5_6, V0_5_15, V0_5_20, V0_5_21, V0_5_23)


def cuda_reduction(nbytes: int, dtype: str = "uint8", dims: tuple[int, ...] | None = None) -> Call:
    """Shaped as torch's reduce_tensor of a CUDA tensor (15 rebuild arguments)."""
    return Call(
        Global("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        (Global("torch", "Tensor"), Call(TORCH_SIZE, (dims or (nbytes,),)), (1,), 0,
         Global("torch.storage", "TypedStorage"), Global("torch", dtype), "GPU-0", b"h" * 64, nbytes, 0,
         False, b"/torch_1", 0, b"e" * 64, True),
    )  # fmt: skip


def local_named(cls: tuple[str, str], values: list[Any]) -> bytes:
    """verl's push: [(name, LocalSerializedTensor(values=[one pickled tensor per TP rank]))], pickled
    (sglang/srt/weight_sync/utils.py:31-99@0.5.6)."""
    return dumps([("w", Instance(Global(*cls), {"values": values}))])


def read(data: bytes, version: tuple[int, int, int], rank: int = 0) -> Any:
    """What TensorRefit._check does for one rank: unpickle, then read the push, unwrapping for `rank`."""

    def deserialize(inner: bytes) -> Any:
        return unpickle(inner, version, stand_in)

    return read_push(deserialize(data), None, lambda v: local_tensor(v, rank, deserialize))


@pytest.mark.parametrize("version", VERSIONS)
def test_local_serialized_tensor_is_read_at_its_own_path(version: tuple[int, int, int]) -> None:
    """Defined in model_runner.py up to 0.5.15.post1, in model_runner_components/weight_updater.py from
    0.5.20 (C-REFIT-TENSOR-LOCAL): each rank deserializes values[tp_rank] with the same unpickler."""
    own = LOCAL_SERIALIZED_OLD if version < V0_5_20 else LOCAL_SERIALIZED_NEW
    ranks = [dumps(cuda_reduction(32, "bfloat16", (4, 4))), dumps(cuda_reduction(16, "float32", (4,)))]
    for rank, (shape, dtype) in enumerate([((4, 4), "bfloat16"), ((4,), "float32")]):
        bucket = read(local_named(own, ranks), version, rank)
        assert [(e.name, e.shape, e.dtype) for e in bucket.entries] == [("w", shape, dtype)]
    with pytest.raises(SchedulerError, match="IndexError"):
        read(local_named(own, ranks[:1]), version, rank=1)  # values[tp_rank] out of range
    b64 = [packing.to_wire(ranks[0])]  # a str value is base64-decoded first
    assert read(local_named(own, b64), version).entries[0].shape == (4, 4)
    with pytest.raises(SchedulerError, match=r"binascii\.Error"):
        read(local_named(own, ["not base64!"]), version)


@pytest.mark.parametrize("version", VERSIONS)
def test_local_serialized_tensor_at_the_other_path_kills_the_scheduler(version: tuple[int, int, int]) -> None:
    """The path the version lacks: blocked by the prefix allowlist (≤0.5.15.post1: no
    model_runner_components prefix) or allowed but absent from its module (find_class AttributeError)."""
    other = LOCAL_SERIALIZED_NEW if version < V0_5_20 else LOCAL_SERIALIZED_OLD
    with pytest.raises(SchedulerError) as err:
        read(local_named(other, [dumps(cuda_reduction(4))]), version)
    if version < V0_5_20:
        assert err.value.exc_type == "RuntimeError" and "CVE-2025-10164" in err.value.message
    else:
        assert err.value.exc_type == "AttributeError"
        assert err.value.message.startswith("Can't get attribute 'LocalSerializedTensor' on <module")


@pytest.mark.parametrize("version", VERSIONS)
def test_not_a_pickle_kills_the_scheduler(version: tuple[int, int, int]) -> None:
    """C-REFIT-TENSOR-PICKLE: SafeUnpickler(...).load() on bytes that are not a pickle raises outside any try,
    at every version; the inner payload of a LocalSerializedTensor too."""
    with pytest.raises(SchedulerError, match="UnpicklingError"):
        read(b"x", version)
    own = LOCAL_SERIALIZED_OLD if version < V0_5_20 else LOCAL_SERIALIZED_NEW
    with pytest.raises(SchedulerError, match="UnpicklingError"):
        read(local_named(own, [b"x"]), version)


def test_a_value_that_is_not_a_tensor() -> None:
    """`_unwrap_tensor` calls `.to(device)`: a plain value raises AttributeError; an object of a class the
    emulator does not construct is answered as unmodelled, not guessed."""
    with pytest.raises(SchedulerError, match="AttributeError") as err:
        read(dumps([("w", 3)]), V0_5_23)
    assert err.value.message == "'int' object has no attribute 'to'"
    with pytest.raises(Unmodelled):
        read(dumps([("w", Call(Global("torch", "Tensor"), ()))]), V0_5_6)


def test_prefix_allowlist_grows_by_version() -> None:
    """utils/common.py:2219-2255@0.5.6; torch_npu. from 0.5.10; sglang.srt.managers. and disaggregation. from
    0.5.15; model_runner_components.weight_updater. from 0.5.20; exact globals from 0.5.21."""
    managers = ("sglang.srt.managers.io_struct", "GenerateReqInput")
    assert allowed(V0_5_6, *managers) is not None
    assert allowed(V0_5_15, *managers) is None
    assert allowed(V0_5_6, "torch_npu.x", "y") is not None and allowed(V0_5_15, "torch_npu.x", "y") is None
    assert allowed(V0_5_15, *LOCAL_SERIALIZED_NEW) is not None
    assert allowed(V0_5_20, *LOCAL_SERIALIZED_NEW) is None
    for version in (V0_5_21, V0_5_23):
        assert (
            allowed(version, *LOCAL_SERIALIZED_NEW) is None
            and allowed(version, *LOCAL_SERIALIZED_OLD) is None
        )
        assert "Blocked unsafe global" in str(allowed(version, "torch_npu.x", "y"))
