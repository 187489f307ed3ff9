"""The trainer of test_real_sglang_headroom.py: a real torch process that keeps GPU memory after its lease.

One iteration through rljob.trainer: take the lease (Handoff.train), allocate `--keep-gib` GiB on the GPU
(written, so the driver really backs it), write the model's checkpoint of `--seed` as version `--version`
and publish it (a disk refit), keep the allocation after the lease. On SIGUSR1 it frees it (del,
empty_cache: the process and its CUDA context stay, as a trainer's do); on SIGTERM it exits. Each step is
one JSON line on stdout: {"event": "kept", "bytes": ...}, {"event": "freed", ...}.

python tests/gpu/headroom_trainer.py --keep-gib 20 --weights-dir DIR --version 1 --seed 7
(the model: RLJOB_GPU_MODEL, rljob.testing.gpu_models)"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rljob.testing.gpu_models import load_model, spec_from_env
from rljob.trainer import Handoff

GiB = 1 << 30


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": round(time.time(), 3), **fields}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--keep-gib", type=float, required=True)
    p.add_argument("--weights-dir", required=True)
    p.add_argument("--version", default="1")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    model = load_model(spec_from_env())
    freeing = []
    signal.signal(signal.SIGUSR1, lambda *_: freeing.append(True))
    kept: torch.Tensor | None = None
    with Handoff().train(timeout=900) as lease:
        nbytes = int(args.keep_gib * GiB)
        kept = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        kept.fill_(3)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        say("kept", bytes=nbytes, reserved=torch.cuda.memory_reserved(), free=free, total=total)
        path = model.write(Path(args.weights_dir) / f"v{args.version}", args.seed)
        lease.publish(args.version, str(path))
        say("published", version=args.version, path=str(path))
    while not freeing:
        time.sleep(0.05)  # SIGTERM (the test's stop) ends the process
    del kept
    torch.cuda.empty_cache()
    say("freed", reserved=torch.cuda.memory_reserved())
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
