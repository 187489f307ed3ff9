"""The trainer of test_real_vllm.py when the vLLM emulator stands in for vLLM (RLJOB_GPU_VLLM_STAND_IN): the
same lease and publish through rljob.trainer as real_trainer.py, with the emulator's weights (float32
tensors, rljob.testing.trainer.make_tensors) instead of a model on a GPU, pushed as vLLM's IPC updates whose
stand-in handles the emulator reads (rljob.testing.ipc_stand_in). Writes `<result-dir>/iteration-<i>.json`
after each iteration, as real_trainer.py does.

python tests/gpu/vllm_stand_in_trainer.py --plan disk,tensor,disk --weights-dir DIR --ipc-dir DIR
    --result-dir DIR"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rljob.testing.ipc_stand_in import vllm_update
from rljob.testing.trainer import make_tensors, write_checkpoint
from rljob.trainer import Handoff
from rljob.trainer.engines.vllm import digest as vllm_digest

SIZE = 16 << 10
LAYOUT = vllm_digest.ModelLayout("LlamaForCausalLM")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", default="disk,tensor,disk")
    p.add_argument("--weights-dir", required=True)
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--result-dir", required=True)
    args = p.parse_args()
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    handoff = Handoff()
    for i, kind in enumerate(args.plan.split(",")):
        version = str(1 + i)
        tensors = make_tensors(str(100 + i), SIZE)
        path = Path(args.weights_dir) / f"v{version}"
        rec = {"iteration": i, "kind": kind, "version": version}
        with handoff.train(timeout=600) as lease:
            write_checkpoint(path, version, tensors)  # a tensor version too: the test's own calls load it
            rec["path"] = str(path)
            lease.publish(version, str(path) if kind == "disk" else None)
        if kind == "tensor":
            t0 = time.perf_counter()
            with handoff.refit_window(timeout=600) as window:
                names = sorted(tensors)
                for name in names:
                    window.push_update(vllm_update({name: tensors[name]}, Path(args.ipc_dir)))
                window.add_digest(vllm_digest.digest_named_tensors([(n, tensors[n]) for n in names], LAYOUT))
            rec["window_seconds"] = time.perf_counter() - t0
        (out / f"iteration-{i}.json").write_text(json.dumps(rec, indent=1))
        print(f"iteration {i} ({kind}, version {version}) done", flush=True)


if __name__ == "__main__":
    main()
