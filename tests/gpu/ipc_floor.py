"""Plain-torch floor of a CUDA IPC refit, two processes on one GPU, no HTTP, no agent: the producer holds
`--bytes` of bf16 (15 GiB unless told) in buckets of each `--bucket-mib` size (the last one of a size
holds the rest) and sends one bucket at a time as torch's ForkingPickler bytes (IPC handles); the
consumer unpickles them (opening the handles), copies each into its own buffer of as many bytes,
synchronizes and answers. Timed per round: "drop" rounds release each bucket's mapping after the copy,
as SGLang does when its update call returns; "keep" rounds hold every mapping (torch then reuses the
opened handles). Also an in-process device-to-device copy of the same bytes. Writes JSON to --out.

python tests/gpu/ipc_floor.py --out FILE [--bytes N] [--bucket-mib 1024,256]"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import statistics
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp

GiB = 1 << 30


def consumer(requests: Any, answers: Any, total: int) -> None:
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    kept: list[Any] = []
    while True:
        msg = requests.get()
        if msg is None:
            return
        keep, offset, data = msg
        t0 = time.perf_counter()
        flat = pickle.loads(data)  # rebuild_cuda_tensor: cudaIpcOpenMemHandle unless still open
        t1 = time.perf_counter()
        n = flat.numel()
        dst[offset : offset + n].copy_(flat)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if keep:
            kept.append(flat)
        elif kept:
            kept.clear()
        del flat  # the receiver's release: stream sync, ref count, cudaIpcCloseMemHandle
        t3 = time.perf_counter()
        answers.put((t1 - t0, t2 - t1, t3 - t2))


def run_round(buckets: list[torch.Tensor], requests: Any, answers: Any, keep: bool) -> dict[str, float]:
    parts = {"serialize": 0.0, "open": 0.0, "copy": 0.0, "close": 0.0}
    torch.cuda.synchronize()
    started = time.perf_counter()
    offset = 0
    for b in buckets:
        t0 = time.perf_counter()
        buf = io.BytesIO()
        ForkingPickler(buf).dump(b)
        parts["serialize"] += time.perf_counter() - t0
        requests.put((keep, offset, buf.getvalue()))
        o, c, cl = answers.get()
        parts["open"] += o
        parts["copy"] += c
        parts["close"] += cl
        offset += b.numel()
    return {"seconds": time.perf_counter() - started, **parts}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--bytes", type=int, default=15 * GiB, help="the bytes refitted (even: bf16)")
    p.add_argument("--bucket-mib", default="1024,256", help="bucket sizes, one set of rounds each")
    args = p.parse_args()
    total = args.bytes
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(requests, answers, total), daemon=True)
    proc.start()
    results: dict[str, Any] = {"bytes": total, "gib": total / GiB}
    try:
        for bucket_mib in (int(m) for m in args.bucket_mib.split(",")):
            size = bucket_mib << 20
            sizes = [min(size, total - off) for off in range(0, total, size)]
            g = torch.Generator(device="cuda").manual_seed(bucket_mib)
            bf16 = [torch.empty(n // 2, device="cuda", dtype=torch.bfloat16) for n in sizes]
            buckets = [b.normal_(generator=g).view(torch.uint8) for b in bf16]
            del bf16
            n = len(buckets)
            rounds = {
                "drop_cold": run_round(buckets, requests, answers, keep=False),
                "drop_reused_1": run_round(buckets, requests, answers, keep=False),
                "drop_reused_2": run_round(buckets, requests, answers, keep=False),
                "keep_first": run_round(buckets, requests, answers, keep=True),
                "keep_reused_1": run_round(buckets, requests, answers, keep=True),
                "keep_reused_2": run_round(buckets, requests, answers, keep=True),
            }
            run_round(buckets[:1], requests, answers, keep=False)  # the consumer lets go of the kept ones
            results[f"{bucket_mib}MiB"] = {"buckets": n, **rounds}
            del buckets
            torch.cuda.empty_cache()
        src = torch.empty(total // 2, device="cuda", dtype=torch.bfloat16).normal_().view(torch.uint8)
        dst = torch.empty_like(src)
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        results["d2d_copy_seconds"] = times
        results["d2d_copy_median_seconds"] = statistics.median(times[1:])
    finally:
        requests.put(None)
        proc.join(30)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for k, v in results.items():
        print(k, v)


if __name__ == "__main__":
    main()
