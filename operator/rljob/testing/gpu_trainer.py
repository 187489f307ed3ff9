"""A real training step on the GPU memory SGLang released: the GPU tier's trainer.

Waits until the agent reports Serving, notes the GPU's free memory, asks for the GPU through
`rljob.trainer.Handoff`, and once the lease is granted builds a decoder-only transformer in bf16 (AdamW,
bf16 states), sizes its batch so that the step's peak (`torch.cuda.max_memory_allocated`: weights, grads,
optimizer state, activations) is `--memory-fraction` of the memory free at the grant, runs `--steps` steps,
writes the model to a safetensors file, gives every byte back (`empty_cache`) and publishes the version
and path. The figures go to `--result` as JSON.

    python -m rljob.testing.gpu_trainer --version 2 --weights-dir DIR --result FILE [--memory-fraction 0.8]
        [--d-model 4096] [--layers 8] [--heads 32] [--seq 2048] [--vocab 32768] [--steps 3]
    env: RLJOB_AGENT_URL (default http://127.0.0.1:8472)

Needs torch with CUDA and safetensors; imported only when run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rljob.trainer import Handoff

GiB = 1 << 30
CALIBRATION_BATCHES = (4, 8)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rljob.testing.gpu_trainer", description=__doc__)
    p.add_argument("--version", required=True, help="weight version to publish")
    p.add_argument("--weights-dir", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True, help="JSON figures are written here")
    p.add_argument("--memory-fraction", type=float, default=0.8, help="peak allocated / free at the grant")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for Serving and the lease")
    return p


def _model(torch: Any, d: int, layers: int, heads: int, vocab: int) -> Any:
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc1 = nn.Linear(d, 4 * d, bias=False)
            self.fc2 = nn.Linear(4 * d, d, bias=False)

        def forward(self, x: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Model(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    return Model()


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch, self.args = torch, args
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(int(args.version) if str(args.version).isdigit() else 0)

    def batch(self, n: int) -> Any:
        a = self.args
        return self.torch.randint(0, a.vocab, (n, a.seq + 1), generator=self.gen, device="cuda")

    def step(self, model: Any, opt: Any, tokens: Any) -> tuple[float, int, int]:
        """One step: the loss, the peak allocated bytes of forward + backward, and of the whole step."""
        F, cuda = self.torch.nn.functional, self.torch.cuda
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, self.args.vocab), tokens[:, 1:].reshape(-1))
        del logits
        loss.backward()
        cuda.synchronize()
        peak = int(cuda.max_memory_allocated())
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.item())  # synchronises
        return value, peak, int(cuda.max_memory_allocated())

    def train(self, free_at_grant: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Calibrate, train, return (figures, state dict on the GPU)."""
        torch, a = self.torch, self.args
        with torch.device("cuda"):
            model = _model(torch, a.d_model, a.layers, a.heads, a.vocab).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6)
        params = sum(p.numel() for p in model.parameters())
        started = time.monotonic()
        self.step(model, opt, self.batch(1))  # creates the optimizer state
        # Activations grow linearly with the batch: two batch sizes give bytes per sequence.
        small, large = CALIBRATION_BATCHES
        p1, p2 = self.step(model, opt, self.batch(small))[1], self.step(model, opt, self.batch(large))[1]
        per_seq = max(1, (p2 - p1) // (large - small))
        target = int(a.memory_fraction * free_at_grant)
        batch = max(1, (target - (p1 - small * per_seq)) // per_seq)
        calibrate_s = time.monotonic() - started
        tokens, losses, step_s, ooms = None, [], [], 0
        while True:
            try:
                tokens = self.batch(batch)
                peak = 0
                for _ in range(a.steps):
                    t0 = time.monotonic()
                    loss, _, step_peak = self.step(model, opt, tokens)
                    step_s.append(time.monotonic() - t0)
                    losses.append(loss)
                    peak = max(peak, step_peak)
                break
            except torch.cuda.OutOfMemoryError:
                pass
            # Out of memory: the calibration was off. Retry smaller, outside the handler (its traceback
            # holds the step's activations).
            ooms += 1
            if ooms > 3:
                raise RuntimeError(f"out of memory at batch {batch} after {ooms - 1} smaller retries")
            tokens, losses, step_s = None, [], []
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            batch = max(1, int(batch * 0.75))
        figures = {
            "params": params,
            "batch": batch,
            "seq": a.seq,
            "tokens_per_step": batch * a.seq,
            "calibration_peaks_bytes": [p1, p2],
            "calibrate_seconds": round(calibrate_s, 3),
            "target_peak_bytes": target,
            "ooms_retried": ooms,
            "max_memory_allocated": peak,  # torch.cuda.max_memory_allocated over the measured steps
            "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
            "losses": losses,
            "step_seconds": [round(s, 4) for s in step_s],
        }
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        del model, opt, tokens
        return figures, state


def main(argv: list[str] | None = None) -> int:
    # The trainer is not under torch_memory_saver: expandable segments keep fragmentation down.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = _parser().parse_args(argv)
    import torch
    from safetensors.torch import save_file

    handoff = Handoff()
    st = handoff.wait_for_stage("Serving", timeout=args.timeout)
    torch.cuda.init()
    free_before, total = (int(x) for x in torch.cuda.mem_get_info())
    out: dict[str, Any] = {
        "served_version_before": st["engine"].get("servedVersion"),
        "gpu_total_bytes": total,
        "free_before_request": free_before,
    }
    trainer = Trainer(args)
    t_request = time.time()
    with handoff.train(timeout=args.timeout) as lease:
        out["granted_after_seconds"] = round(time.time() - t_request, 3)
        out["free_at_grant"] = int(torch.cuda.mem_get_info()[0])
        t0 = time.monotonic()
        figures, state = trainer.train(out["free_at_grant"])
        out.update(figures)
        out["train_seconds"] = round(time.monotonic() - t0, 3)
        args.weights_dir.mkdir(parents=True, exist_ok=True)
        path = args.weights_dir / f"model-v{args.version}.safetensors"
        tmp = path.with_suffix(".tmp")
        t0 = time.monotonic()
        save_file(state, str(tmp), metadata={"weight_version": str(args.version)})
        tmp.replace(path)
        out["save_seconds"] = round(time.monotonic() - t0, 3)
        out["file_bytes"] = path.stat().st_size
        out["path"] = str(path)
        del state
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # SGLang resumes into this memory next
        out["free_at_publish"] = int(torch.cuda.mem_get_info()[0])
        out["allocated_at_publish"] = int(torch.cuda.memory_allocated())
        lease.publish(str(args.version), str(path))
    out["losses_finite"] = all(math.isfinite(v) for v in out["losses"])
    args.result.write_text(json.dumps(out, indent=2))
    print(json.dumps({"event": "trained", **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
