"""SGLang's own tensor refit, with no agent: version `--seed`'s weights pushed straight to SGLang's
/update_weights_from_tensor in the SDK's flattened buckets (rljob.trainer.engines.sglang.packing: the same
packing, each bucket packed while the previous push is in flight), the last push flushing the cache: a first
round (`cold`: the bucket buffers allocated, the last push carrying the version), a second (`reused`: the same
buffers, as a trainer's later refits). What the agent's tensor refit is compared with in
real_iterations.py.

Then an instrumented round of the same buckets: after each push, SGLang's
`sglang:weight_load_duration_seconds{source="tensor"}` (its scheduler's time in the update: opening the
handle, loading the weights, closing it) read from /metrics: where a push's time goes inside SGLang.

Steps on the test's word (files in --signal-dir, so that the test times what is SGLang's: the process's
start and the weights' creation are not): `weights` (make them on the GPU, write `ready`), `push` (push,
write the result to --result, exit).

python tests/gpu/direct_push.py --url URL --model tiny|8b [--model-root DIR] --seed S --version V
    --signal-dir DIR --result FILE [--bucket-mib 2048]"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import real_models
import torch

from rljob.trainer.engines.sglang import packing

GAUGE = re.compile(r'^sglang:weight_load_duration_seconds\{[^}]*source="tensor"[^}]*\}\s+(\S+)', re.M)


class SGLang:
    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=300)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")

    def push(self, payloads: list[str], version: str | None, last: bool) -> float:
        body: dict[str, Any] = {
            "serialized_named_tensors": payloads,
            "load_format": packing.LOAD_FORMAT,
            "flush_cache": last,
        }
        if version is not None:
            body["weight_version"] = version
        t0 = time.perf_counter()
        status, text = self.call("POST", "/update_weights_from_tensor", body)
        seconds = time.perf_counter() - t0
        if status != 200 or not json.loads(text).get("success"):
            raise RuntimeError(f"update_weights_from_tensor: {status} {text[:500]}")
        return seconds

    def weight_load_seconds(self) -> float | None:
        status, text = self.call("GET", "/metrics")
        values = [float(v) for v in GAUGE.findall(text)] if status == 200 else []
        return max(values) if values else None


def push_all(
    sglang: SGLang,
    named: list[tuple[str, Any]],
    buffers: packing.BucketBuffers,
    bucket_bytes: int,
    version: str | None,
    instrumented: bool,
) -> dict[str, Any]:
    """Every bucket to SGLang, each packed while the previous push is in flight (a ring of 2 buffers, as
    the SDK); with `instrumented`, SGLang's own load time read after each push instead (no overlap)."""
    named, plans = packing.prepare(named, bucket_bytes, 1)
    report = packing.PushReport()
    sends: list[float] = []
    loads: list[float | None] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1) as sender:
        in_flight = None
        for k, plan in enumerate(plans):
            bucket = packing.pack_and_serialize(named, plan, buffers, bucket_bytes, 1, report)
            if in_flight is not None:
                sends.append(in_flight.result())
            last = k == len(plans) - 1
            in_flight = sender.submit(sglang.push, bucket.payloads, version if last else None, last)
            if instrumented:
                sends.append(in_flight.result())
                in_flight = None
                loads.append(sglang.weight_load_seconds())
        if in_flight is not None:
            sends.append(in_flight.result())
    return {
        "window_seconds": time.perf_counter() - started,
        "buckets": report.buckets,
        "bytes": report.bytes,
        "pack_seconds": report.pack_seconds,
        "serialize_seconds": report.serialize_seconds,
        "send_seconds": sends,
        "weight_load_seconds": loads,
        "new_buffers": report.new_buffers,
    }


def wait_for(path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} from the test within {timeout}s")
        time.sleep(0.005)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", choices=real_models.MODELS, required=True)
    p.add_argument("--model-root")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--signal-dir", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--bucket-mib", type=int, default=packing.DEFAULT_BUCKET_BYTES >> 20)
    args = p.parse_args()
    model = real_models.load(args.model, args.model_root)
    torch.cuda.init()
    (args.signal_dir / "started").write_text("")
    wait_for(args.signal_dir / "weights")
    weights = real_models.cuda_weights(model, args.seed)
    (args.signal_dir / "ready").write_text("")
    wait_for(args.signal_dir / "push")
    sglang = SGLang(args.url)
    buffers = packing.BucketBuffers()
    bucket_bytes = args.bucket_mib << 20
    named = list(weights.items())
    result = {"cold": push_all(sglang, named, buffers, bucket_bytes, args.version, instrumented=False)}
    result["reused"] = push_all(sglang, named, buffers, bucket_bytes, None, instrumented=False)
    result["instrumented"] = push_all(sglang, named, buffers, bucket_bytes, None, instrumented=True)
    args.result.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v["window_seconds"] for k, v in result.items()}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
