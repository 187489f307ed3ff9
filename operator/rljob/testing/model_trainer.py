"""A trainer of a real model for the GPU loop: SGLang's rollout, then the model's next weights through the
trainer SDK, by path (disk) or by CUDA IPC (tensor), as the RLJob's refit source says.

Per iteration, as the simulated trainer (`rljob.testing.trainer`, whose rollout and checks it reuses): wait
until the agent serves, run the rollout against SGLang (between the rollout gate's two edges with
`--gate-dir`), report its samples, and take the lease. In the lease, the next version's weights are those of
seed `--seed-base + version` of the model `--model` (rljob.testing.gpu_models: tiny, 8b or module:attr):

- RLJOB_REFIT_SOURCE disk: `model.write(<weights dir>/v<version>, seed)`; every byte of GPU memory the
  trainer took is given back, then the path is published.
- tensor: the weights on the GPU, the version published, then pushed through the refit window
  (`push_named_tensors`, the SDK's CUDA-IPC packing); the tensors and the SDK's buckets are given back as the
  window closes, before the agent resumes SGLang's KV cache.

In the last iteration, before publishing, the trainer computes the reference the test checks SGLang
against: transformers' Llama forward of those weights on fixed prompts (each prompt token's logprob given
the ones before it, and the greedy next token), in `<weights dir>/reference-v<version>.json`.

A model is any object with `write(directory, seed) -> Path` (a checkpoint directory SGLang and transformers
load: config.json, safetensors, tokenizer.json) and either `cuda_weights(seed)` ({name: bf16 CUDA tensor}) or
`weights(seed)` ({name: (shape, bf16 bits as uint16 numpy)}, as rljob.testing.tiny_model.TinyLlama).

    python -m rljob.testing.model_trainer --model-path /weights/base [--model tiny|8b|MODULE:FACTORY]
        [--seed-base 100] [--gate-dir DIR] [the rollout flags of rljob.testing.trainer]
    env: RLJOB_AGENT_URL, RLJOB_ENGINE_SERVER_URL, RLJOB_REFIT_SOURCE (disk | tensor), RLJOB_WEIGHTS_DIR,
         RLJOB_ITERATIONS (when --iterations is not given)

Needs torch with CUDA, transformers, tokenizers; imported only when run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rljob.testing import trainer as sim
from rljob.testing.gpu_models import load_model, model_weights
from rljob.testing.rollout_gate import RolloutGate
from rljob.trainer import Handoff

# The prompts of the logprob check (any byte-level BPE encodes them).
CHECK_PROMPTS = {
    "capital": "question: what is the capital of france? the capital of france is",
    "weights": "iteration three: the model weights of the rollout are",
    "numbers": "one two three four five six seven eight nine ten",
}


def check_prompts(model_path: Path) -> dict[str, list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    return {name: list(tok.encode(text).ids) for name, text in CHECK_PROMPTS.items()}


def reference(model_path: Path, weights: dict[str, Any], device: str = "cuda") -> dict[str, Any]:
    """transformers' Llama forward of `weights` (bf16 on their device, the tensors themselves: no copy), per
    check prompt: its ids, the logprob of each token after the first, the greedy next token with its
    logprob, and the 5 likeliest next tokens with theirs (`top`)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            net = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = net.load_state_dict(weights, strict=False, assign=True)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, ids in check_prompts(model_path).items():
            logits = net(torch.tensor([ids], device=device)).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            token_lp = logp[:-1].gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
            top = torch.topk(logp[-1], 5)
            out[name] = {
                "input_ids": ids,
                "input_logprobs": token_lp.tolist(),
                "next_token": int(top.indices[0]),
                "next_logprob": float(top.values[0]),
                "top": [[int(t), float(v)] for t, v in zip(top.indices, top.values, strict=True)],
            }
    del net
    return out


def give_back_gpu() -> int:
    """Every cached block back to the driver; the bytes torch still holds (0 when nothing is left)."""
    import torch

    gc.collect()
    if not torch.cuda.is_initialized():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved())


def _log(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "ts": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()


class ModelTrainer:
    def __init__(
        self, args: argparse.Namespace, handoff: Handoff, model: Any, weights_dir: Path, source: str
    ) -> None:
        self.args, self.handoff, self.model = args, handoff, model
        self.weights_dir, self.source = weights_dir, source
        self.rollout = sim.Rollout(
            os.environ.get("RLJOB_ENGINE_SERVER_URL", "http://127.0.0.1:30000"),
            os.environ.get("RLJOB_ENGINE_API_KEY"),
            args,
        )
        self.gate = RolloutGate(Path(args.gate_dir), args.timeout) if args.gate_dir else None

    def run(self, iterations: int) -> None:
        expected: str | None = None
        for iteration in range(1, iterations + 1):
            state = self.handoff.wait_for_stage("Serving", timeout=self.args.timeout)
            served = state["engine"]["servedVersion"]
            if expected is not None and served != expected:
                raise sim.StaleServing(f"agent serves {served!r} after this trainer published {expected!r}")
            with self.gate.edges(iteration) if self.gate is not None else contextlib.nullcontext():
                stats = self.rollout.run(iteration, served)
            _log("rollout", iteration=iteration, served=served, **stats)
            self.handoff.report_rollout(samples=stats["completed"])
            expected = sim.next_version(served)
            self.step(iteration, expected, last=iteration == iterations)
        final = self.handoff.wait_for_stage("Serving", timeout=self.args.timeout)["engine"]["servedVersion"]
        if final != expected:
            raise sim.StaleServing(f"agent serves {final!r} after this trainer published {expected!r}")
        _log("done", iterations=iterations, served=final)

    def step(self, iteration: int, version: str, last: bool) -> None:
        seed = self.args.seed_base + int(version)
        rec: dict[str, Any] = {
            "iteration": iteration,
            "version": version,
            "seed": seed,
            "source": self.source,
        }
        weights: dict[str, Any] | None = None
        with self.handoff.train(timeout=self.args.timeout) as lease:
            granted = time.perf_counter()
            if self.source == "tensor" or last:
                weights = model_weights(self.model, seed, self.args.device)
                rec["weights_seconds"] = round(time.perf_counter() - granted, 3)
            if last:
                assert weights is not None
                t0 = time.perf_counter()
                ref = reference(Path(self.args.model_path), weights, self.args.device)
                path = self.weights_dir / f"reference-v{version}.json"
                path.write_text(json.dumps(ref))
                rec["reference_seconds"] = round(time.perf_counter() - t0, 3)
                rec["reference"] = str(path)
            if self.source == "disk":
                t0 = time.perf_counter()
                checkpoint = self.model.write(self.weights_dir / f"v{version}", seed)
                rec["write_seconds"] = round(time.perf_counter() - t0, 3)
                weights = None
                rec["held_at_publish"] = give_back_gpu()  # SGLang resumes into this memory next
                lease.publish(version, str(checkpoint))
                rec["path"] = str(checkpoint)
            else:
                lease.publish(version)
            rec["lease_seconds"] = round(time.perf_counter() - granted, 3)
        if self.source == "tensor":
            assert weights is not None
            t0 = time.perf_counter()
            with self.handoff.refit_window(timeout=self.args.timeout) as window:
                if window.version != version:
                    raise sim.StaleServing(
                        f"refit window for {window.version}, this trainer published {version}"
                    )
                entered = time.perf_counter()
                report = window.push_named_tensors(list(weights.items()))
            rec["window_wait_seconds"] = round(entered - t0, 3)
            rec["window_seconds"] = round(time.perf_counter() - entered, 4)
            push = dataclasses.asdict(report)
            rec["push"] = {k: push[k] for k in ("codec", "buckets", "tensors", "bytes", "pack_seconds")}
            weights = None
            self.handoff.free_refit_buffers()
            rec["held_after_push"] = give_back_gpu()  # before the agent resumes SGLang's KV cache
        _log("published", **rec)


def parser() -> argparse.ArgumentParser:
    p = sim.parser()
    p.prog = "python -m rljob.testing.model_trainer"
    p.description = __doc__
    p.add_argument("--model-path", required=True, help="the checkpoint SGLang launched from (its config)")
    p.add_argument("--model", default="tiny", help="rljob.testing.gpu_models: tiny, 8b or module:attr")
    p.add_argument("--seed-base", type=int, default=100, help="version v trains the weights of seed base + v")
    p.add_argument(
        "--device",
        default="cuda",
        help="where the weights and the reference live: cpu only to test a disk loop",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    # Not under torch_memory_saver: expandable segments give freed memory back whole.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = parser().parse_args(argv)
    source = os.environ.get("RLJOB_REFIT_SOURCE", "disk")
    if source not in ("disk", "tensor"):
        print(f"RLJOB_REFIT_SOURCE must be disk or tensor here, not {source!r}", file=sys.stderr)
        return 1
    if source == "tensor" and args.device != "cuda":
        print("a tensor refit pushes CUDA tensors: --device cuda", file=sys.stderr)
        return 1
    iterations = args.iterations or int(os.environ.get("RLJOB_ITERATIONS", "0"))
    if iterations < 1:
        print("the number of iterations is needed (--iterations or RLJOB_ITERATIONS)", file=sys.stderr)
        return 1
    if source == "tensor":
        import torch  # noqa: F401  # imported as a torch trainer has it: the SDK warms its codec in the lease

    weights_dir = Path(os.environ.get("RLJOB_WEIGHTS_DIR", "/tmp/rljob-weights"))
    weights_dir.mkdir(parents=True, exist_ok=True)
    trainer = ModelTrainer(args, Handoff(), load_model(args.model), weights_dir, source)
    try:
        trainer.run(iterations)
    except sim.StaleServing as e:
        print(f"STALE SERVING: {e}", file=sys.stderr, flush=True)
        return 2
    except sim.BadRollout as e:
        print(f"BAD ROLLOUT: {e}", file=sys.stderr, flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
