"""Runs SGLang's own tensor-hash kernels (the `/weights_checker` checksum's per-parameter hash) under Triton's
interpreter, on the CPU: used by test_tensor_hash.py, one process per kernel file (the interpreter must be
chosen before triton is imported).

    TRITON_INTERPRET=1 python tests/unit/sglang_hash_reader.py KERNEL_FILE < job.json > result.json

KERNEL_FILE: sglang/srt/layers/multimodal.py (0.5.15.post1) or sglang/kernels/ops/memory/gpu_tensor_hash.py
(from 0.5.20), loaded as a file (it imports only torch and triton). job: {"inputs": [base64 bytes, ...],
"partials": [[uint64, ...], ...]}. For each input, what `gpu_tensor_hash` computes, with its own kernels,
defaults (read from its signature) and final mix; only its `tensor.is_cuda` asserts and the device are left
out (the interpreter runs on CPU tensors), and its word padding is repeated on the CPU. For each partials
list, the kernel's tree reduction (`add_tree_reduce_u64_kernel`) to one value. result: {"hashes": [...],
"sums": [...]}."""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import sys
from typing import Any


def main() -> None:
    import torch
    import triton

    spec = importlib.util.spec_from_file_location("sglang_tensor_hash", sys.argv[1])
    assert spec is not None and spec.loader is not None
    mod: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    defaults = {k: p.default for k, p in inspect.signature(mod.gpu_tensor_hash).parameters.items()}
    job = json.load(sys.stdin)

    def words(data: bytes) -> Any:  # _as_uint32_words, on the CPU
        tb = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.zeros(0, dtype=torch.uint8)
        )
        pad = (4 - (tb.numel() & 3)) & 3
        if pad:
            tb = torch.cat([tb, torch.zeros(pad, dtype=torch.uint8)])
        return tb.view(torch.uint32)

    def reduce(cur: Any) -> int:
        chunk = defaults["reduce_chunk"]
        while cur.numel() > 1:
            n = cur.numel()
            nxt = torch.empty(triton.cdiv(n, chunk), dtype=torch.uint64)
            mod.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, n, CHUNK=chunk)
            cur = nxt
        return int(cur.item()) & ((1 << 64) - 1)

    def gpu_tensor_hash(data: bytes) -> int:
        u32 = words(data)
        n = u32.numel()
        if n == 0:
            return 0
        seed, tile = defaults["seed"], defaults["tile_words"]
        partials = torch.empty(triton.cdiv(n, tile), dtype=torch.uint64)
        mod.hash_tiles32_kernel_blocked[(partials.numel(),)](
            u32,
            partials,
            n,
            seed1=seed & 0xFFFFFFFF,
            seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
            FM_C1=mod.FMIX32_C1,
            FM_C2=mod.FMIX32_C2,
            POS_A=mod.POS_C1,
            POS_B=mod.POS_C2,
            TILE=tile,
            BLOCK=defaults["block_words"],
            USE_CG=defaults["use_cg"],
            num_warps=defaults["num_warps"],
            num_stages=defaults["num_stages"],
        )
        return int(mod._final_splitmix64(reduce(partials)))

    hashes = [gpu_tensor_hash(base64.b64decode(x)) for x in job.get("inputs", [])]

    def as_uint64(values: list[int]) -> Any:  # torch builds no uint64 from Python ints above 2**63
        signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
        return torch.tensor(signed, dtype=torch.int64).view(torch.uint64)

    sums = [reduce(as_uint64(p)) for p in job.get("partials", [])]
    json.dump({"hashes": hashes, "sums": sums}, sys.stdout)


if __name__ == "__main__":
    main()
