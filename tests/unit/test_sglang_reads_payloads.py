"""SGLang's own code reads what the trainer SDK writes (rljob.trainer.engines.sglang.packing, its torch-free
writer): for each recorded SGLang version whose receive path imports on CPU, a subprocess with that version on
sys.path (hack/sglang-wheels.sh, run by `make install`) runs `monkey_patch_torch_reductions`,
`MultiprocessingSerializer.deserialize` (its SafeUnpickler) and `FlattenedTensorBucket.reconstruct_tensors`
on every payload shape the SDK writes, and the tensors it rebuilds must be the ones packed, byte for byte
(tests/unit/sglang_reader.py; only opening the CUDA IPC handle is stood in for). A version whose wheel is
not unpacked fails: nothing here skips."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rljob.agent.engines.sglang.client import SGLangClient
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.api.agent import InitWeightsGroup
from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer.engines.sglang.packing import (
    BucketPlan,
    Call,
    Global,
    TensorSpec,
    bucket_payload,
    dumps,
    metadata_entry,
    plan_buckets,
    to_wire,
)

CACHE = Path(os.environ.get("RLJOB_SGLANG_CACHE", Path.home() / ".cache/rljob/sglang"))
READER = Path(__file__).with_name("sglang_reader.py")
# The recorded versions (docs/sglang-conformance.md) whose deserializer imports on CPU.
VERSIONS = ("0.5.6", "0.5.15.post1", "0.5.20", "0.5.21", "0.5.23")
# Those whose managers/io_struct.py (the request dataclasses) imports on CPU with hack/sglang-wheels.sh's
# packages: 0.5.6's needs sgl_kernel (a CUDA build), 0.5.15.post1's registers a config name that the
# newest transformers already has ("'qwen3_asr' is already used by a Transformers config").
IO_STRUCT_VERSIONS = ("0.5.20", "0.5.21", "0.5.23")
UUID = "GPU-3f1c0c4e-9a5b-4d2e-8c7f-0123456789ab"
ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int64": 8, "uint8": 1}
BUCKET_BYTES = 4096


@dataclass(frozen=True)
class Named:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEM[self.dtype]
        for d in self.shape:
            n *= d
        return n


# What a model's state dict holds: several dtypes (one bucket each), a tensor larger than a bucket (a bucket
# of its own), a 0-d scalar, an empty tensor, a name longer than 255 bytes and a dimension over 65535 (the
# writer's long string and 4-byte int opcodes).
TENSORS = [
    Named("model.embed_tokens.weight", "bfloat16", (64, 8)),
    Named("model.layers.0.input_layernorm.weight", "float32", (8,)),
    Named("model.layers.0.self_attn.q_proj.weight", "bfloat16", (48, 64)),  # 6 KiB > one bucket
    Named("model.layers.0.mlp.gate_proj.weight", "bfloat16", (16, 8)),
    Named("lm_head.weight", "float16", (32, 8)),
    Named("model.layers.0.mlp.down_proj.weight_scale", "float8_e4m3fn", (4, 4)),
    Named("num_batches_tracked", "int64", ()),
    Named("model.layers.0.empty", "bfloat16", (0, 8)),
    Named("model." + "very_long_module_name." * 12 + "weight", "float32", (2, 2)),
    Named("model.rotary.inv_freq_flat", "uint8", (70000,)),
]


def reused_buffer_reduction(nbytes: int, handle: bytes, storage_bytes: int, storage_offset: int) -> Call:
    """What packing.reduced_tensor writes for `buffer[:nbytes]` of a reused uint8 CUDA buffer: torch's
    rebuild_cuda_tensor and its 15 arguments (test_packing's GPU test checks the types against a real
    one), the device as its UUID."""
    return cuda_reduction(
        nbytes,
        device=UUID,
        handle=handle,
        storage_bytes=storage_bytes,
        storage_offset=storage_offset,
        ref_counter=b"/torch_1_" + handle[:4].hex().encode(),
    )


@dataclass
class Packed:
    job: dict[str, Any]
    expected: list[list[list[Any]]]  # per bucket: [name, dtype, shape, sha256] per tensor


def pack(tensors: list[Named], seed: int = 5) -> Packed:
    """Buckets as the SDK plans them, each in a reused buffer (at least BUCKET_BYTES, the odd one inside a
    larger allocation), the tensors' bytes copied where the plan says; one wire payload per bucket."""
    rng = random.Random(seed)
    data = {t.name: rng.randbytes(t.nbytes) for t in tensors}
    specs = [TensorSpec(t.name, t.dtype, t.shape, t.nbytes, "cuda:0") for t in tensors]
    plans: list[BucketPlan] = plan_buckets(specs, BUCKET_BYTES)
    buckets, expected = [], []
    for i, plan in enumerate(plans):
        storage = max(plan.nbytes, BUCKET_BYTES)
        offset = 512 * (i % 2)  # the buffer's storage at an offset inside the allocation the handle names
        block = bytearray(rng.randbytes(offset + storage))
        for p in plan.placements:
            block[offset + p.start : offset + p.end] = data[tensors[p.index].name]
        handle = hashlib.sha256(f"bucket-{i}".encode()).digest() * 2  # 64 bytes, one per allocation
        entries = [
            metadata_entry(tensors[p.index].name, tensors[p.index].shape, plan.dtype, p.start, p.end)
            for p in plan.placements
        ]
        wire = to_wire(bucket_payload(reused_buffer_reduction(plan.nbytes, handle, storage, offset), entries))
        buckets.append({"wire": wire, "buffers": {handle.hex(): base64.b64encode(bytes(block)).decode()}})
        expected.append(
            [
                [t.name, t.dtype, list(t.shape), hashlib.sha256(data[t.name]).hexdigest()]
                for t in (tensors[p.index] for p in plan.placements)
            ]
        )
    return Packed({"uuid": UUID, "buckets": buckets, "refused": []}, expected)


def agent_requests(version: str) -> list[dict[str, Any]]:
    """Every JSON body the agent's SGLangClient sends to SGLang `version`, as it sends it (its own methods,
    its version quirks), recorded by a local server that answers each call with success."""
    sent: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        sent.append({"path": request.path, "body": body})
        return web.json_response({"success": True, "message": "recorded"})

    async def run() -> None:
        app = web.Application()
        app.router.add_route("POST", "/{route:.*}", record)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = SGLangClient(
            f"http://127.0.0.1:{port}", api_key=None, admin_api_key=None, call_timeout_s=10, observe=_ignore
        )
        client.quirks = quirks = SGLangQuirks.detect(version)
        await client.start()
        try:
            tags = ["kv_cache", "weights", "cuda_graph"]
            for mode in ("abort", "retract"):
                await client.pause(mode)
            await client.release(tags)
            await client.resume(tags)
            await client.update_weights_from_disk("/weights/v3", "3")
            if quirks.weight_update_session:
                await client.begin_weight_update()
            await client.update_weights_from_tensor(["cGF5bG9hZA=="], "flattened_bucket", "3")
            await client.update_weights_from_tensor(["cGF5bG9hZA=="], None, None)
            group = InitWeightsGroup(
                master_address="trainer-0", master_port=29500, rank_offset=1, world_size=2
            )
            await client.init_weights_update_group(group.model_dump())
            await client.update_weights_from_distributed(["w"], ["bfloat16"], [[4, 8]], group.group_name, "3")
            if quirks.weight_update_session:
                await client.end_weight_update()
            await client.update_weight_version("3")
            await client.continue_generation()
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(run())
    return [r for r in sent if r["body"] is not None]


def _ignore(_operation: str, _seconds: float) -> None:
    pass


@functools.cache
def sglang_reads(version: str) -> dict[str, Any]:
    """SGLang `version`'s own code on the SDK's payloads (TENSORS packed, and a payload with a global
    outside its allowlist) and, where io_struct imports, on the agent's request bodies."""
    packed = pack(TENSORS)
    packed.job["refused"] = [to_wire(dumps(Call(Global("os", "system"), ("true",))))]
    if version in IO_STRUCT_VERSIONS:
        packed.job["requests"] = agent_requests(version)
    return {
        "expected": packed.expected,
        "requests": packed.job.get("requests"),
        **read_with_sglang(version, packed.job),
    }


def read_with_sglang(version: str, job: dict[str, Any]) -> dict[str, Any]:
    root = CACHE / version
    if not (root / "sglang").is_dir():
        pytest.fail(f"SGLang {version} is not unpacked in {root}: run `make install` (hack/sglang-wheels.sh)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(READER)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["version"] == version  # SGLang's own package answered, not something else on the path
    return result


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_rebuilds_every_bucket_the_sdk_writes_byte_for_byte(version: str) -> None:
    result = sglang_reads(version)
    expected = result["expected"]
    assert len(expected) >= 6  # the plan really made several buckets (dtypes, the oversized one)
    assert [b["tensors"] for b in result["buckets"]] == expected
    for bucket, tensors in zip(result["buckets"], expected, strict=True):
        assert bucket["metadata_class"] == ["sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"]
        assert bucket["flattened"] == ["torch.uint8", [sum(ITEM[t[1]] * _numel(t[2]) for t in tensors)]]
    # SGLang's patch turned the UUID back into the device index before torch would open the handle.
    assert result["devices"] == [0] * len(expected)


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_refuses_a_payload_outside_its_allowlist(version: str) -> None:
    refused = sglang_reads(version)["refused"]
    # SafeUnpickler's own refusal (0.5.6: "Blocked unsafe class loading (os.system), ..."; later: "Blocked
    # unsafe global (os.system) during pickle ..."), not pickle.loads running it.
    assert refused[0] is not None and "Blocked unsafe" in refused[0] and "(os.system)" in refused[0], refused


@pytest.mark.parametrize("version", IO_STRUCT_VERSIONS)
def test_sglang_binds_every_request_body_the_agent_sends(version: str) -> None:
    """Each body builds the io_struct class SGLang's route binds it to (no key that SGLang has no field
    for) and passes pydantic's validation of it, as FastAPI binds it (no type it would answer 422 to)."""
    result = sglang_reads(version)
    sent = {r["path"] for r in result["requests"]}
    assert {"/pause_generation", "/release_memory_occupation", "/update_weights_from_tensor"} <= sent
    for req, bound in zip(result["requests"], result["read_requests"], strict=True):
        assert bound["path"] == req["path"] and bound["routed"], (version, bound)
        assert bound["class"] is not None, (version, bound)  # the route binds its body to an io_struct class
        assert set(req["body"]) <= set(bound["fields"]), (version, req["path"], req["body"], bound["fields"])
        assert bound["init"] is None and bound["validated"] is None, (version, req, bound)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
