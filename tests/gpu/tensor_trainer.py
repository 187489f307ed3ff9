"""The trainer process of test_gpu_tensor_refit.py: Llama-3-8B-shaped bf16 weights (14.96 GiB) made on the
GPU in each lease (the memory SGLang released) and given back before SGLang resumes, as a colocated
trainer's, handed to SGLang through rljob.trainer (Handoff.train, then RefitSession.push_named_tensors),
iteration by iteration as `--plan` says: `tensor@MiB` (new weights, CUDA IPC refit in buckets of MiB;
the bucket buffers of the previous refit are reused when the size is the same, else freed first) or
`disk` (new weights saved as safetensors, published by path). Each iteration's figures go, last, to
`<result-dir>/iteration-<n>.json` (the test resumes SGLang once it is there): the synchronized
device-to-device copy of the same bytes (the floor), the push report and the checksum of the tensors in
push order computed as the emulator computes its own (tensor_refit.device_checksum).

python tests/gpu/tensor_trainer.py --plan tensor@1024,tensor@1024,disk --first-version 2 --result-dir DIR"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from rljob.emulator.tensor_refit import device_checksum
from rljob.trainer import Handoff

HIDDEN, KV, FFN, VOCAB, LAYERS = 4096, 1024, 14336, 128256, 32


def llama3_8b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (FFN, HIDDEN)),
            (p + "mlp.up_proj.weight", (FFN, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, FFN)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return [*shapes, ("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def fill(named: dict[str, torch.Tensor], seed: int) -> None:
    """New weights for a version: random bf16 (never zeros: they hide unwritten bytes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in named.values():
        t.normal_(0.0, 0.02, generator=g)
    torch.cuda.synchronize()


def d2d_floor(named: dict[str, torch.Tensor], repeats: int = 5) -> dict[str, Any]:
    """The same bytes copied once on this GPU into one buffer (synchronized): the floor of any refit."""
    total = sum(t.numel() * t.element_size() for t in named.values())
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        off = 0
        for t in named.values():
            n = t.numel() * t.element_size()
            dst[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del dst
    torch.cuda.empty_cache()
    return {"bytes": total, "seconds": times, "median_seconds": statistics.median(times[1:])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="tensor@1024,tensor@1024,disk")
    p.add_argument("--first-version", type=int, default=2)
    p.add_argument("--result-dir", required=True)
    p.add_argument("--weights-dir", required=True)
    args = p.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)

    shapes = llama3_8b_shapes()
    (out / "trainer.json").write_text(
        json.dumps({"tensors": len(shapes), "bytes": sum(math.prod(s) * 2 for _, s in shapes)})
    )
    handoff = Handoff()
    bucket_bytes = 0
    for i, step in enumerate(args.plan.split(",")):
        kind, _, mib = step.partition("@")
        version = str(args.first_version + i)
        rec: dict[str, Any] = {"iteration": i, "kind": kind, "version": version}
        if kind == "tensor" and int(mib) << 20 != bucket_bytes:
            rec["freed_buffer_bytes"] = handoff.free_refit_buffers()  # another size: new buffers
            torch.cuda.empty_cache()
            bucket_bytes = int(mib) << 20
        rec["bucket_bytes"] = bucket_bytes
        with handoff.train(timeout=600) as lease:
            rec["free_at_grant"] = torch.cuda.mem_get_info()[0]
            # The weights live in the memory SGLang released, as a colocated trainer's model does.
            t0 = time.perf_counter()
            named = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes}
            fill(named, 100 + i)
            rec["make_weights_seconds"] = time.perf_counter() - t0
            if kind == "tensor":
                rec["floor"] = d2d_floor(named)
                lease.publish(version)
            else:
                path = Path(args.weights_dir) / f"model-v{version}.safetensors"
                path.parent.mkdir(parents=True, exist_ok=True)
                from safetensors.torch import save_file

                t0 = time.perf_counter()
                save_file(named, str(path))
                rec["save_seconds"] = time.perf_counter() - t0
                rec["path"] = str(path)
                lease.publish(version, str(path))
        if kind == "tensor":
            window_wait = time.perf_counter()
            with handoff.refit_window(timeout=600) as w:
                opened = time.perf_counter()
                report = w.push_named_tensors(named.items(), bucket_bytes=bucket_bytes)
                pushed = time.perf_counter()
            closed = time.perf_counter()
            rec["window_wait_seconds"] = opened - window_wait
            rec["push_named_tensors_seconds"] = pushed - opened
            rec["window_seconds"] = closed - opened  # first bucket packed .. last push answered, closed
            rec["report"] = dataclasses.asdict(report)
            rec["buffer_bytes"] = handoff._buffers().nbytes
            t0 = time.perf_counter()
            rec["checksum"] = device_checksum([named[n].reshape(-1).view(torch.uint8) for n in report.order])
            rec["checksum_seconds"] = time.perf_counter() - t0
        # The weights back before the emulator resumes its KV cache (the bucket buffers stay for the next
        # refit of the same size: the regions are sized to leave room for them); this file comes last.
        del named
        torch.cuda.empty_cache()
        rec["free_after"] = torch.cuda.mem_get_info()[0]
        (out / f"iteration-{i}.json").write_text(json.dumps(rec, indent=1))
        print(f"iteration {i} ({kind}, version {version}) done", flush=True)


if __name__ == "__main__":
    main()
