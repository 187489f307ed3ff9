"""The trainer process of the real-SGLang tests: a torch trainer beside real SGLang, through rljob.trainer.

Per iteration of `--plan` (`disk` or `tensor`), version `first + i`, weights of seed `seed_base + i` of the
`--model` (real_models.py: tiny, or 8b under --model-root): take the lease (Handoff.train); unless the
iteration is in `--at-once` (a trainer that publishes as soon as it holds the lease), measure the memory
free at the grant and allocate most of it in a child process (the trainer's footprint in the memory SGLang
released) and, on the first such iteration, time torch_memory_saver's own pause and resume of a region as
large as SGLang's freed memory (the floor of a release and a resume); make the version's weights on the GPU
(in the lease: the memory SGLang released); with `--reference` (the tiny model) compute transformers'
logprobs of them (each prompt's token logprobs and next greedy token); publish by path (disk: the
checkpoint written) or by version and push the tensors through the refit window (tensor: the SDK's
CUDA-IPC packing). Then give the GPU memory back (the weights; the bucket buffers are kept for the next
refit) before SGLang resumes, as a colocated trainer must, and write the version's checkpoint (a tensor
version too: the test loads it to check what was pushed). Writes `<result-dir>/reference-<version>.json`
and, last, `<result-dir>/iteration-<i>.json`: the test resumes SGLang only once it is there.

python tests/gpu/real_trainer.py --plan disk,tensor,disk --model tiny --model-dir DIR --prompts FILE
    --weights-dir DIR --floor-bytes-file FILE --result-dir DIR [--at-once 0] [--reference]"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import real_models
import torch

from rljob.trainer import Handoff

FILL_FRACTION = 0.9  # of the memory free at the grant


def reference(
    model_dir: Path, weights: dict[str, torch.Tensor], prompts: dict[str, list[int]]
) -> dict[str, Any]:
    """transformers' Llama forward of `weights` (bf16 on this GPU): per prompt, the logprob of each token
    after the first given the ones before it, the greedy next token with its logprob, and the 5 best."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    net = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    missing, unexpected = net.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            logits = net(torch.tensor([ids], device="cuda")).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            token_lp = logp[:-1].gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
            nxt = int(logp[-1].argmax())
            top = torch.topk(logp[-1], 5)
            out[name] = {
                "input_logprobs": token_lp.tolist(),
                "next_token": nxt,
                "next_logprob": float(logp[-1, nxt]),
                "top": [[int(t), float(v)] for t, v in zip(top.indices, top.values, strict=True)],
            }
    del net
    torch.cuda.empty_cache()
    return out


def tms_floor(nbytes: int, repeats: int = 3) -> dict[str, Any]:
    """torch_memory_saver's pause and resume of one region of `nbytes`, devices synchronised around each:
    what any release or resume of that much memory costs at least."""
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    with tms.region(tag="floor"):
        block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    pauses, resumes = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tms.pause("floor")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        tms.resume("floor")
        torch.cuda.synchronize()
        pauses.append(t1 - t0)
        resumes.append(time.perf_counter() - t1)
    del block
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "pause_seconds": pauses, "resume_seconds": resumes}


def in_child(floor_bytes: int) -> dict[str, Any]:
    """occupy (and tms_floor of `floor_bytes`, if any) in a process of its own: what it holds is the driver's
    again when it exits (torch_memory_saver's pool keeps a resumed region until then), before SGLang's next
    resume needs it."""
    r = subprocess.run(
        [sys.executable, __file__, "--child", str(floor_bytes)], capture_output=True, text=True, timeout=300
    )
    if r.returncode != 0:
        raise RuntimeError(f"child failed: {r.stderr[-2000:]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def occupy(fraction: float) -> dict[str, Any]:
    """Most of the free memory in one tensor, written on the GPU: what the trainer could use."""
    free, total = torch.cuda.mem_get_info()
    nbytes = int(free * fraction)
    t0 = time.perf_counter()
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(7)
    torch.cuda.synchronize()
    rec = {
        "free_at_grant": free,
        "total": total,
        "allocated": nbytes,
        "fill_seconds": time.perf_counter() - t0,
    }
    rec["max_allocated"] = torch.cuda.max_memory_allocated()
    del block
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        out: dict[str, Any] = {"occupy": occupy(FILL_FRACTION)}
        if int(sys.argv[2]):
            out["tms_floor"] = tms_floor(int(sys.argv[2]))
        print(json.dumps(out), flush=True)
        # No interpreter teardown: torch_memory_saver's torch hook then frees the pool's blocks through a
        # path that aborts ("only support interesting region", seen on an H100); the exit frees them all.
        os._exit(0)
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="disk,tensor,disk")
    p.add_argument("--model", choices=real_models.MODELS, default="tiny")
    p.add_argument("--model-root", help="the 8b model's root (holding base/)")
    p.add_argument("--first-version", type=int, default=1)
    p.add_argument("--seed-base", type=int, default=100)
    p.add_argument("--model-dir", required=True, help="the launch checkpoint (its config and tokenizer)")
    p.add_argument("--weights-dir", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--floor-bytes-file", required=True, help="JSON {bytes}: written by the test at release")
    p.add_argument("--result-dir", required=True)
    p.add_argument("--at-once", default="", help="iterations (0-based, comma-separated) that publish at once")
    p.add_argument("--reference", action="store_true", help="transformers' logprobs of each version")
    args = p.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text())
    at_once = {int(i) for i in args.at_once.split(",") if i}
    model = real_models.load(args.model, args.model_root)
    handoff = Handoff()
    floor_taken = False
    for i, kind in enumerate(args.plan.split(",")):
        version, seed = str(args.first_version + i), args.seed_base + i
        rec: dict[str, Any] = {"iteration": i, "kind": kind, "version": version, "seed": seed}
        rec["at_once"] = i in at_once
        path = Path(args.weights_dir) / f"v{version}"
        weights: dict[str, torch.Tensor] = {}
        requested = time.perf_counter()
        with handoff.train(timeout=600) as lease:
            rec["lease_wait_seconds"] = time.perf_counter() - requested
            granted = time.perf_counter()
            if i not in at_once:
                floor_file = Path(args.floor_bytes_file)
                floor = 0 if floor_taken else int(json.loads(floor_file.read_text())["bytes"])
                rec |= in_child(floor)
                floor_taken = True
            if kind == "tensor" or args.reference:
                t0 = time.perf_counter()
                weights = real_models.cuda_weights(model, seed)
                rec["make_weights_seconds"] = time.perf_counter() - t0
            if args.reference and i not in at_once:
                t0 = time.perf_counter()
                (out / f"reference-{version}.json").write_text(
                    json.dumps(reference(Path(args.model_dir), weights, prompts))
                )
                rec["reference_seconds"] = time.perf_counter() - t0
            if kind == "tensor" and i not in at_once:
                rec["d2d_copy_seconds"] = d2d_copy(weights)
            rec["free_at_publish"], _ = torch.cuda.mem_get_info()
            if kind == "disk":
                t0 = time.perf_counter()
                real_models.write(model, path, seed)
                rec["write_seconds"] = time.perf_counter() - t0
                rec["path"] = str(path)
                lease.publish(version, str(path))
            else:
                lease.publish(version)
            rec["lease_seconds"] = time.perf_counter() - granted
        if kind == "tensor":
            opened = time.perf_counter()
            with handoff.refit_window(timeout=600) as window:
                entered = time.perf_counter()
                report = window.push_named_tensors(weights.items())
            rec["window_wait_seconds"] = entered - opened
            rec["window_seconds"] = time.perf_counter() - entered  # packed, pushed, answered, closed
            rec["push_bytes"] = report.bytes
            rec["report"] = dataclasses.asdict(report)
        # The GPU back before SGLang resumes its KV cache (the bucket buffers stay: the next refit reuses
        # them; SGLang's sizing leaves room for them), then the version's checkpoint for the test's check.
        weights.clear()
        gc.collect()
        torch.cuda.empty_cache()
        rec["free_after"], _ = torch.cuda.mem_get_info()
        rec["kept_buffer_bytes"] = handoff._buffers().nbytes if kind == "tensor" else None
        if kind == "tensor":
            t0 = time.perf_counter()
            real_models.write(model, path, seed)
            torch.cuda.empty_cache()
            rec["write_seconds"] = time.perf_counter() - t0
            rec["path"] = str(path)
        (out / f"iteration-{i}.json").write_text(json.dumps(rec, indent=1))
        print(f"iteration {i} ({kind}, version {version}) done", flush=True)


def d2d_copy(weights: dict[str, torch.Tensor]) -> float:
    """The same bytes copied once on this GPU into one buffer (synchronized): a floor of any refit."""
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    for t in weights.values():
        n = t.numel() * t.element_size()
        flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
        off += n
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del flat
    torch.cuda.empty_cache()
    return seconds


if __name__ == "__main__":
    main()
