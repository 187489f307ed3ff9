"""The trainer SDK's tensor packing (rljob.trainer.engines.sglang.packing) against the format SGLang reads,
and the emulator's reader of it (rljob.emulator.tensor_refit). The envelope is written with a stand-in for
torch's CUDA IPC reduction; tests that need torch (`make install` has it) or CUDA skip without it.
SGLang's own code reads these payloads in test_sglang_reads_payloads.py (every recorded version)."""

from __future__ import annotations

import base64
import importlib.util
import io
import math
import pickle
import random
import struct
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob.emulator import tensor_refit
from rljob.emulator.tensor_refit import SchedulerError, TensorRef, read_push, stand_in, unpickle
from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.packing import (
    TORCH_SIZE,
    BucketPlan,
    Call,
    Global,
    Instance,
    TensorSpec,
    bucket_payload,
    dumps,
    metadata_entry,
    plan_buckets,
)

HAS_TORCH = importlib.util.find_spec("torch") is not None
V0_5_6, V0_5_23 = (0, 5, 6), (0, 5, 23)
ITEM = {"bfloat16": 2, "float32": 4, "uint8": 1, "int64": 8}


def spec(name: str, dtype: str, *shape: int, device: str = "cuda:0") -> TensorSpec:
    return TensorSpec(name, dtype, shape, math.prod(shape) * ITEM[dtype], device)


def fake_cuda_reduction(nbytes: int, handle: bytes = b"\x07" * 64) -> Call:
    """What reduced_tensor(<1-D uint8 CUDA tensor of nbytes>) returns, with made-up handles (the argument
    types are checked against a real CUDA reduction in test_real_cuda_reduction_has_the_fakes_shape)."""
    return cuda_reduction(nbytes, handle=handle)


def payload_for(specs: list[TensorSpec], plan: BucketPlan) -> bytes:
    entries = [
        metadata_entry(specs[p.index].name, specs[p.index].shape, plan.dtype, p.start, p.end)
        for p in plan.placements
    ]
    return bucket_payload(fake_cuda_reduction(plan.nbytes), entries)


# --- planning --------------------------------------------------------------------------------------


def test_plan_groups_by_dtype_in_first_seen_order_and_keeps_input_order() -> None:
    specs = [
        spec("a", "bfloat16", 4, 4),
        spec("norm", "float32", 4),
        spec("b", "bfloat16", 8),
        spec("c", "bfloat16", 2, 2),
    ]
    plans = plan_buckets(specs, bucket_bytes=1 << 20)
    assert [(p.dtype, [specs[x.index].name for x in p.placements]) for p in plans] == [
        ("bfloat16", ["a", "b", "c"]),
        ("float32", ["norm"]),
    ]
    first = plans[0].placements
    assert [(x.start, x.end) for x in first] == [(0, 32), (32, 48), (48, 56)]  # contiguous, no padding
    assert plans[0].nbytes == 56


def test_plan_cuts_at_bucket_bytes_and_gives_an_oversized_tensor_its_own_bucket() -> None:
    sizes = {"a": 60, "b": 60, "big": 250, "c": 10}
    specs = [spec(name, "uint8", n) for name, n in sizes.items()]
    plans = plan_buckets(specs, bucket_bytes=100)
    assert [[specs[x.index].name for x in p.placements] for p in plans] == [["a"], ["b"], ["big"], ["c"]]
    assert [p.nbytes for p in plans] == [60, 60, 250, 10]
    with pytest.raises(ValueError, match="empty bucket"):
        plan_buckets([], 100)
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(specs, 0)


def test_plan_never_mixes_devices() -> None:
    specs = [spec("a", "bfloat16", 2, device="cuda:0"), spec("b", "bfloat16", 2, device="cuda:1")]
    assert [p.device for p in plan_buckets(specs, 1 << 20)] == ["cuda:0", "cuda:1"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(ITEM)), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 600),
)
def test_plan_places_every_tensor_once_in_uniform_aligned_buckets(
    tensors: list[tuple[str, list[int]]], bucket_bytes: int
) -> None:
    specs = [spec(f"t{i}", d, *shape) for i, (d, shape) in enumerate(tensors)]
    plans = plan_buckets(specs, bucket_bytes)
    placed = sorted(x.index for p in plans for x in p.placements)
    assert placed == list(range(len(specs)))
    for p in plans:
        assert all(specs[x.index].dtype == p.dtype for x in p.placements)
        ends = [0] + [x.end for x in p.placements]
        assert [x.start for x in p.placements] == ends[:-1]  # contiguous
        assert all(x.end - x.start == specs[x.index].nbytes for x in p.placements)
        assert all(x.start % ITEM[p.dtype] == 0 for x in p.placements)  # view(dtype) needs this
        assert p.nbytes <= bucket_bytes or len(p.placements) == 1
    for dtype in {p.dtype for p in plans}:  # input order kept within a dtype, across its buckets
        order = [x.index for p in plans if p.dtype == dtype for x in p.placements]
        assert order == sorted(order)


# --- the pickle writer ----------------------------------------------------------------------------

primitives = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner, inner, inner)
        | st.tuples(inner)
        | st.dictionaries(st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(primitives)
def test_dumps_reads_back_with_the_standard_unpickler(obj: Any) -> None:
    data = dumps(obj)
    assert pickle.loads(data) == obj
    assert data[:2] == b"\x80\x04" and data[-1:] == b"."


@dataclass
class Point:
    name: str
    xy: tuple[int, int]


class _MapUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, mapping: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.mapping = mapping

    def find_class(self, module: str, name: str) -> Any:
        return self.mapping[(module, name)]


def test_globals_calls_and_instances_are_written_as_pickle_writes_them() -> None:
    obj = [
        Instance(Global("some.module", "Point"), {"name": "p", "xy": (1, 2)}),
        Call(Global("some.module", "pair"), (3, 4)),
        Global("some.module", "CONST"),
    ]
    mapping = {("some.module", "Point"): Point, ("some.module", "pair"): lambda a, b: (a, b)}
    mapping[("some.module", "CONST")] = "const"
    assert _MapUnpickler(dumps(obj), mapping).load() == [Point("p", (1, 2)), (3, 4), "const"]
    # the standard pickler writes a dataclass instance with the same opcodes (NEWOBJ, BUILD)
    std = pickle.dumps(Point("p", (1, 2)), protocol=4)
    assert b"\x81" in std and std.rstrip(b".").endswith(b"b")
    with pytest.raises(TypeError):
        dumps(object())


def test_metadata_entry_is_sglangs_flattened_tensor_metadata() -> None:
    e = metadata_entry("w", (4, 2), "bfloat16", 16, 32)
    assert e.cls == Global("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
    # field order and meaning of C-REFIT-BUCKET-LAYOUT; numel counts bytes of the uint8 view
    assert list(e.state) == ["name", "shape", "dtype", "start_idx", "end_idx", "numel"]
    assert e.state["numel"] == 16 and e.state["dtype"] == Global("torch", "bfloat16")
    assert e.state["shape"] == Call(TORCH_SIZE, ((4, 2),))


def test_a_bucket_s_metadata_is_written_once_and_the_same_bytes() -> None:
    """Every refit sends the same buckets: their metadata lists are written once (metadata_fragment) and
    spliced into each payload, which is byte for byte what writing them anew gives."""
    specs = [spec("embed", "bfloat16", 64, 8), spec("w", "bfloat16", 8, 8), spec("norm", "bfloat16", 8)]
    (plan,) = plan_buckets(specs, bucket_bytes=4096)
    key = tuple(
        (specs[p.index].name, specs[p.index].shape, plan.dtype, p.start, p.end) for p in plan.placements
    )
    packing.metadata_fragment.cache_clear()
    cached = packing.metadata_fragment(key)
    assert packing.metadata_fragment(key) is cached
    assert packing.metadata_fragment.cache_info().hits == 1
    ipc = fake_cuda_reduction(plan.nbytes)
    assert bucket_payload(ipc, cached) == payload_for(specs, plan)
    bucket = read_push(unpickle(bucket_payload(ipc, cached), V0_5_23, stand_in), "flattened_bucket")
    assert [e.name for e in bucket.entries] == ["embed", "w", "norm"]


def test_wire_form_is_base64_of_the_pickle() -> None:
    raw = dumps({"a": 1})
    assert base64.b64decode(packing.to_wire(raw), validate=True) == raw


# --- read back as SGLang reads it (the emulator's reader, no torch) --------------------------------


@pytest.mark.parametrize("version", [V0_5_6, V0_5_23])
def test_payload_reads_back_as_the_plan_says(version: tuple[int, int, int]) -> None:
    specs = [spec("embed", "bfloat16", 64, 8), spec("norm", "float32", 8), spec("w", "bfloat16", 8, 8)]
    for plan in plan_buckets(specs, bucket_bytes=4096):
        obj = unpickle(payload_for(specs, plan), version, stand_in)
        flat = obj["flattened_tensor"]
        assert isinstance(flat, TensorRef) and flat.shape == (plan.nbytes,) and flat.dtype.name == "uint8"
        bucket = read_push(obj, "flattened_bucket")
        assert [(e.name, e.shape, e.dtype, e.start, e.end) for e in bucket.entries] == [
            (specs[p.index].name, specs[p.index].shape, plan.dtype, p.start, p.end) for p in plan.placements
        ]
        assert bucket.nbytes == plan.nbytes


def _bucket(entries: list[Instance], nbytes: int, reduction: Any = None) -> bytes:
    return bucket_payload(reduction or fake_cuda_reduction(nbytes), entries)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (metadata_entry("w", (3,), "bfloat16", 1, 7), "storage_offset() must be divisible by 2"),
        (metadata_entry("w", (2, 2), "bfloat16", 0, 6), "shape '[2, 2]' is invalid for input of size 3"),
        (metadata_entry("w", (4,), "float32", 0, 18), "size(-1) must be divisible by 4"),
        # Python's slice clamping: 32 bytes are there, not 64
        (metadata_entry("w", (32,), "bfloat16", 0, 64), "shape '[32]' is invalid for input of size 16"),
    ],
)
def test_bucket_that_cannot_be_viewed_is_what_kills_sglang(entry: Instance, message: str) -> None:
    obj = unpickle(_bucket([entry], 32), V0_5_23, stand_in)
    with pytest.raises(SchedulerError, match="RuntimeError") as err:
        read_push(obj, "flattened_bucket")
    assert message in err.value.message


def test_load_format_must_match_the_payload() -> None:
    obj = unpickle(_bucket([metadata_entry("w", (2,), "bfloat16", 0, 4)], 4), V0_5_23, stand_in)
    with pytest.raises(SchedulerError, match="ValueError"):
        read_push(obj, None)  # load_weights() iterating a dict
    with pytest.raises(SchedulerError, match="ValueError"):
        read_push(obj, "bucketed")  # the tensors are unwrapped before load_format is looked at
    listed = unpickle(dumps([("w", fake_cuda_reduction(4))]), V0_5_23, stand_in)
    with pytest.raises(SchedulerError, match="NotImplementedError") as err:
        read_push(listed, "bucketed")
    assert err.value.message == "Unknown load_format=bucketed"
    with pytest.raises(SchedulerError, match="TypeError"):
        read_push(listed, "flattened_bucket")
    assert [e.name for e in read_push(listed, None).entries] == ["w"]


def test_blocked_globals_by_version() -> None:
    evil = dumps(Call(Global("os", "system"), ("true",)))
    with pytest.raises(SchedulerError, match=r"Blocked unsafe global \(os.system\) during pickle"):
        unpickle(evil, V0_5_23, stand_in)
    with pytest.raises(SchedulerError, match="CVE-2025-10164"):
        unpickle(evil, V0_5_6, stand_in)
    # 0.5.6 allowed whole module prefixes, 0.5.21+ only exact names
    odd = dumps(Call(Global("torch.functional", "norm"), ()))
    with pytest.raises(SchedulerError, match="Blocked unsafe global"):
        unpickle(odd, V0_5_23, stand_in)
    with pytest.raises(Exception, match="does not construct"):
        unpickle(odd, V0_5_6, stand_in)


def test_a_payload_that_is_not_a_pickle_is_what_kills_sglang() -> None:
    """C-REFIT-TENSOR-PICKLE: SafeUnpickler(...).load() raises on it in the scheduler, at every version."""
    header = struct.pack("<Q", 0x80) + b"{}"  # a small safetensors file starts 0x80 0x00
    for version in (V0_5_6, V0_5_23):
        with pytest.raises(SchedulerError, match="UnpicklingError") as err:
            unpickle(b"xyz", version, stand_in)
        assert err.value.message == "invalid load key, 'x'."
        with pytest.raises(SchedulerError):
            unpickle(header, version, stand_in)
        with pytest.raises(SchedulerError, match="EOFError"):
            unpickle(b"", version, stand_in)


# --- with torch ------------------------------------------------------------------------------------

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def _reference_weight(k: int) -> int:
    """checksum_weights' definition, in plain Python."""
    lo = (k % 2**31 * tensor_refit.CHECKSUM_MULT + tensor_refit.CHECKSUM_ADD) % 2**31
    hi = (k // 2**31 % 2**31 * tensor_refit.CHECKSUM_MULT_HIGH + tensor_refit.CHECKSUM_ADD_HIGH) % 2**31
    return (lo ^ hi) | 1


def _reference_sum(words: dict[int, int]) -> int:
    """h over a sparse stream: word position -> word (every other word zero)."""
    return sum(w * _reference_weight(k) for k, w in words.items()) % 2**64


def _reference_checksum(data: bytes) -> str:
    """device_checksum's definition, in plain Python."""
    padded = data + b"\0" * (-len(data) % 4)
    words = {k: struct.unpack_from("<I", padded, 4 * k)[0] for k in range(len(padded) // 4)}
    return f"wsum64:{_reference_sum(words):016x}:{len(data)}"


def test_buckets_8_gib_apart_swapped_change_the_checksum() -> None:
    """Two 4 KiB buckets 2**31 words (8 GiB) apart, then swapped: the weights differ at that distance (and at
    2**32, 2**40 words), so the sum does; the definition's torch-free half (the GPU tier swaps real ones)."""
    rng = random.Random(11)
    far = 2**31
    a = [rng.getrandbits(32) for _ in range(1024)]
    b = [rng.getrandbits(32) for _ in range(1024)]
    start = 5000
    layout = {start + i: w for i, w in enumerate(a)} | {start + far + i: w for i, w in enumerate(b)}
    swapped = {start + i: w for i, w in enumerate(b)} | {start + far + i: w for i, w in enumerate(a)}
    assert _reference_sum(layout) != _reference_sum(swapped)
    for distance in (far, 2**32, 2**40):
        assert all(_reference_weight(k) != _reference_weight(k + distance) for k in range(start, start + 64))
    for k in (0, 1, far - 1, far, far + 7, 2**40 + 3):
        assert tensor_refit.checksum_weights(k) == _reference_weight(k)


@needs_torch
def test_device_checksum_matches_its_definition_and_ignores_chunking() -> None:
    import torch

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (4103,), dtype=torch.uint8, generator=g)
    whole = tensor_refit.device_checksum([data])
    assert whole == _reference_checksum(bytes(data.tolist()))
    assert tensor_refit.device_checksum([data[:1024], data[1024:4000], data[4000:]]) == whole
    changed = data.clone()
    changed[2048] ^= 1
    assert tensor_refit.device_checksum([changed]) != whole
    swapped = torch.cat([data[4:8], data[:4], data[8:]])
    assert tensor_refit.device_checksum([swapped]) != whole
    far = torch.tensor([0, 2**31 - 1, 2**31, 2**31 + 9, 2**40 + 3], dtype=torch.int64)
    assert tensor_refit.checksum_weights(far).tolist() == [_reference_weight(int(k)) for k in far]
    with pytest.raises(ValueError, match="multiple of 4"):
        tensor_refit.device_checksum([data[:3], data[3:]])


@needs_torch
def test_meta_tensor_reduction_reads_back_as_sglang_reconstructs_it() -> None:
    """torch's real reduction (of a meta tensor: no CUDA here) inside this module's envelope, unpickled by
    the standard unpickler with torch's own rebuild functions, then sliced as tensor_bucket.py does."""
    import torch

    flat = torch.empty(96, dtype=torch.uint8, device="meta")
    entries = [metadata_entry("a", (4, 8), "bfloat16", 0, 64), metadata_entry("b", (8,), "float32", 64, 96)]
    data = bucket_payload(packing.reduced_tensor(flat), entries)

    class Meta:
        pass

    class Reader(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
                return Meta
            assert tensor_refit.allowed(V0_5_23, module, name) is None, (module, name)
            return super().find_class(module, name)

    obj = Reader(io.BytesIO(data)).load()
    got = obj["flattened_tensor"]
    assert got.device.type == "meta" and got.dtype == torch.uint8 and tuple(got.shape) == (96,)
    views = [(m.name, got[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
    assert [(n, tuple(v.shape), v.dtype) for n, v in views] == [
        ("a", (4, 8), torch.bfloat16),
        ("b", (8,), torch.float32),
    ]
    assert isinstance(obj["metadata"][0].shape, torch.Size)
    # the emulator's torch-free reader agrees
    assert [e.name for e in read_push(unpickle(data, V0_5_6, stand_in), "flattened_bucket").entries] == [
        "a",
        "b",
    ]


needs_cuda = pytest.mark.skipif(
    not HAS_TORCH or not __import__("torch").cuda.is_available(), reason="needs torch with a CUDA device"
)


@needs_cuda
def test_real_cuda_reduction_has_the_fakes_shape() -> None:
    import torch

    flat = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")[:4096]
    real = packing.reduced_tensor(flat)
    fake = fake_cuda_reduction(4096)
    assert real.func == fake.func
    assert [type(a) for a in real.args] == [type(a) for a in fake.args]
    assert real.args[1] == fake.args[1] and real.args[5] == fake.args[5]
    assert real.args[6] == str(torch.cuda.get_device_properties(0).uuid)  # C-REFIT-IPC-DEVICE
    assert real.args[8] == 1 << 20  # the whole allocation: the handle is the buffer's


@needs_cuda
def test_cuda_buckets_hold_the_tensors_bytes_where_the_metadata_says() -> None:
    """Packed into reused buffers and serialized: each payload's metadata, read as SGLang reads it, points
    at the tensor's bytes in the bucket buffer. (The IPC handle itself cannot be opened in the process
    that made it; test_gpu_tensor_refit.py opens it from another process.)"""
    import torch

    g = torch.Generator(device="cuda").manual_seed(3)
    named = [
        ("a", torch.randn(64, 32, device="cuda", generator=g).to(torch.bfloat16)),
        ("n", torch.randn(32, device="cuda", generator=g)),
        ("b", torch.randn(32, 64, device="cuda", generator=g).to(torch.bfloat16).t()),  # not contiguous
    ]
    buffers = packing.BucketBuffers()
    report = packing.PushReport()

    packed = list(packing.buckets(named, buffers, bucket_bytes=1 << 20, tp_size=2, report=report))
    assert report.order == ["a", "b", "n"] and report.buckets == 2 and report.new_buffers == 2
    assert packing.ring_size(2) == 3 and packing.ring_size(1) == 2
    by_name = dict(named)
    for b in packed:
        assert len(b.payloads) == 2
        for wire in b.payloads:
            obj = unpickle(base64.b64decode(wire), V0_5_23, stand_in)
            assert obj["flattened_tensor"].device == f"cuda:{packing.device_uuid(0)}"
            for e in read_push(obj, "flattened_bucket").entries:
                t = by_name[e.name]
                got = b.buffer[e.start : e.end].view(t.dtype).reshape(e.shape)
                assert torch.equal(got, t), e.name
    again = packing.PushReport()
    list(packing.buckets(named, buffers, bucket_bytes=1 << 20, tp_size=1, report=again))
    assert again.new_buffers == 0  # the same allocations: the same IPC handles
