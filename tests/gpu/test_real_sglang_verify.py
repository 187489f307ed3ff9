"""Verified weights on real SGLang 0.5.15.post1 (docs/agent.md, "Verified weights").

test_sdk_hash_is_sglangs_gpu_kernel: the SDK's tensor_hash (the SDK's Triton kernel and torch ops on
the GPU, numpy on the CPU) equals SGLang's own `gpu_tensor_hash` (its compiled Triton kernels) on the same
tensors: every dtype a model holds, lengths that are not whole words, more than 1024 tiles (two levels of
its tree reduction), a fused parameter's parts back to back (whole words, and boundaries that split words),
a view at an odd address.

test_sdk_digest_at_8b: the digest of a Llama-3-8B-shaped set of tensors (random bf16, 16.06 GB, 195 SGLang
parameters of 291 tensors) equals SGLang's `gpu_tensor_hash` of each parameter as SGLang holds it (q, k, v
and gate, up concatenated); so does a digest whose tensors are changed on the current stream right after
its `release()` (the hash runs first). Printed and written to $RLJOB_GPU_RESULTS_DIR/verify_hash.json:
the SDK's digest of the 16 GB (one digest, synchronized; its first run compiles the kernels), the host
time to start it, SGLang's kernel over the same parameters, and the torch path on the first 2 layers.

test_three_verified_refits: the real agent (`--gpu-probe nvml`) and a torch trainer in this process, 3
iterations (disk, tensor, disk): drain, release of every tag, grant, publish with the trainer's digest (disk:
`checkpoint_digest` of the checkpoint on the GPU; tensor: `push_named_tensors` hashes what it pushes), refit,
resume. After each refit the agent's check must have held the weights against the trainer's digest and the
weights before the load, and SGLang's own per-parameter hashes (/weights_checker) must be the digest's.
Printed and written to $RLJOB_GPU_RESULTS_DIR/verify.{json,md}: the checker call's wall time (measured here
on the serving engine, and inside the agent's check), the agent's whole check, the trainer's digest.

The model: RLJOB_GPU_MODEL (rljob.testing.gpu_models: tiny by default; 8b for the cost at that size)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver
from gpu_helpers import markdown_table
from real_sglang import RealSGLang, sglang_missing

from rljob.testing.gpu_models import load_model, model_weights, spec_from_env
from rljob.trainer import Handoff
from rljob.trainer.engines.sglang import tensor_hash as th
from rljob.trainer.engines.sglang.digest import ModelLayout, checkpoint_digest, digest_named_tensors

pytestmark = pytest.mark.gpu

PLAN = ("disk", "tensor", "disk")
SEED_BASE = 300  # iteration i's weights: seed SEED_BASE + i (0 is the launch checkpoint's)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealSGLang, Path, Any]]:
    reason = sglang_missing()
    if reason:
        pytest.skip(f"real-SGLang tier: {reason}")
    tmp = tmp_path_factory.mktemp("verify")
    model = load_model(spec_from_env())
    server = RealSGLang(tmp, model.write(tmp / "v0", seed=0))
    try:
        server.wait_ready()
        yield server, tmp, model
    finally:
        server.stop()


def test_sdk_hash_is_sglangs_gpu_kernel() -> None:
    import torch
    from sglang.srt.layers.multimodal import gpu_tensor_hash  # 0.5.15.post1's kernels

    from rljob.trainer.engines.sglang import triton_hash

    assert triton_hash.AVAILABLE, "triton does not import: the SDK would hash with torch ops"
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [
        torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16),
        torch.randn(1025 * 8192 + 3, device="cuda", generator=g),  # > 1024 tiles, not whole tiles
        torch.randn(7, device="cuda", generator=g).to(torch.float16),  # 14 bytes: a padded word
        torch.randint(0, 255, (5,), device="cuda", dtype=torch.uint8, generator=g),
        torch.randint(-128, 127, (3, 11), device="cuda", dtype=torch.int8, generator=g),
        torch.randint(-(2**31), 2**31 - 1, (9, 3), device="cuda", dtype=torch.int64, generator=g),
        torch.randint(0, 255, (40_001,), device="cuda", dtype=torch.uint8, generator=g)[1:],  # odd address
        torch.zeros(0, device="cuda"),
    ]
    for t in cases:
        want = gpu_tensor_hash(t.clone())  # its own word view needs an address of whole words
        assert th.hash_tensor(t) == want, (t.dtype, tuple(t.shape))  # the SDK's Triton kernel
        assert th.hash_tensors_torch([t]) == want, (t.dtype, tuple(t.shape))
        assert th.hash_bytes(t.contiguous().view(torch.uint8).cpu().numpy()) == want
    q, k, v = (torch.randn(256, 256, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    assert th.hash_tensors([q, k, v]) == gpu_tensor_hash(torch.cat([q.flatten(), k.flatten(), v.flatten()]))
    odd = [  # boundaries that split words: 14 bytes, then 16386, then 3
        torch.randn(7, device="cuda", generator=g).to(torch.float16),
        torch.randn(8193, device="cuda", generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (3,), device="cuda", dtype=torch.uint8, generator=g),
    ]
    fused = torch.cat([p.view(torch.uint8).flatten() for p in odd])
    assert th.hash_tensors(odd) == gpu_tensor_hash(fused) == th.hash_tensors_torch(odd)


def _random_8b() -> dict[str, Any]:
    import torch

    from rljob.testing.llama_checkpoint import LLAMA3_8B
    from rljob.testing.tiny_model import TinyLlama

    g = torch.Generator(device="cuda").manual_seed(1)
    return {
        name: torch.randint(-(2**15), 2**15 - 1, shape, device="cuda", dtype=torch.int16, generator=g).view(
            torch.bfloat16
        )
        for name, shape in TinyLlama(LLAMA3_8B).shapes().items()
    }


def test_sdk_digest_at_8b(results_dir: Path) -> None:
    import torch
    from sglang.srt.layers.multimodal import gpu_tensor_hash

    from rljob.trainer.engines.sglang.digest import plan, start_digest_named_tensors

    layout = ModelLayout("LlamaForCausalLM")
    weights = _random_8b()
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())

    def timed_digest() -> tuple[dict[str, str], float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d = digest_named_tensors(weights.items(), layout)
        return d.parameters, time.perf_counter() - t0

    first, first_s = timed_digest()  # compiles the kernels if Triton's cache has none
    sdk, sdk_s = timed_digest()
    pending = start_digest_named_tensors(weights.items(), layout)
    start_s = pending.seconds
    pending.release()
    assert pending.result().parameters == sdk

    whole, _ = plan(weights, layout)
    sglang: dict[str, str] = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for target, names in whole.items():
        parts = [weights[n] for n in names]
        held = parts[0] if len(parts) == 1 else torch.cat([p.flatten() for p in parts])
        sglang[target] = th.hex16(gpu_tensor_hash(held))
    sglang_s = time.perf_counter() - t0
    assert len(sglang) == 195 and first == sdk
    assert not differing(sdk, sglang), differing(sdk, sglang)[:10]

    small = {t: n for t, n in whole.items() if t.startswith(("model.layers.0.", "model.layers.1."))}
    small_bytes = sum(weights[n].numel() * 2 for names in small.values() for n in names)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    by_torch = {t: th.hex16(th.hash_tensors_torch([weights[n] for n in names])) for t, names in small.items()}
    torch_s = time.perf_counter() - t0
    assert by_torch == {t: sdk[t] for t in small}

    # The tensors changed on the current stream right after release(): the hash read them first.
    pending = start_digest_named_tensors(weights.items(), layout)
    pending.release()
    for t in weights.values():
        t.view(torch.int16).bitwise_not_()
    assert pending.result().parameters == sdk
    weights.clear()

    record = {
        "device": torch.cuda.get_device_name(), "bytes": nbytes, "parameters": len(sdk),
        "sdk_digest_seconds": sdk_s, "sdk_digest_first_seconds": first_s, "sdk_start_seconds": start_s,
        "sglang_kernel_seconds": sglang_s,
        "torch_path": {"bytes": small_bytes, "parameters": len(small), "seconds": torch_s},
    }  # fmt: skip
    (results_dir / "verify_hash.json").write_text(json.dumps(record, indent=1))
    gb = nbytes / 1e9
    print(
        f"\nSDK digest of {gb:.2f} GB ({len(sdk)} parameters) on {record['device']}: "
        f"{sdk_s * 1e3:.1f} ms synchronized (first run {first_s * 1e3:.1f} ms; "
        f"starting it {start_s * 1e3:.1f} ms); SGLang's gpu_tensor_hash per parameter "
        f"{sglang_s * 1e3:.1f} ms; torch path {small_bytes / 1e9:.2f} GB in {torch_s * 1e3:.1f} ms "
        f"({torch_s * nbytes / small_bytes:.2f} s for {gb:.2f} GB at that rate)"
    )


def checker(server: RealSGLang) -> tuple[dict[str, str], float]:
    """SGLang's per-parameter hashes and the call's wall time (the engine serving, nothing in flight)."""
    t0 = time.perf_counter()
    r = server.call("POST", "/weights_checker", {"action": "checksum"})
    seconds = time.perf_counter() - t0
    assert r.status == 200 and r.body["success"], r.text
    (rank,) = r.body["ranks"]
    return dict(rank["checksums"]), seconds


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))


def test_three_verified_refits(served: tuple[RealSGLang, Path, Any], results_dir: Path) -> None:
    server, tmp, model = served
    launch, _ = checker(server)
    assert not differing(launch, checkpoint_digest(tmp / "v0", device="cuda").parameters), "launch weights"
    agent = Agent(tmp, server.url, probe="nvml")
    rows, report = [], []
    try:
        st = agent.wait_stage("Ready", timeout=120)
        assert st["engine"]["weights"]["checksum"], st["engine"]["weights"]
        c = AgentDriver(agent)
        c.done("resume", 60)
        handoff = Handoff(agent.trainer_url)
        for i, kind in enumerate(PLAN):
            version, seed = str(i + 1), SEED_BASE + i
            weights = model_weights(model, seed)
            r = agent.trainer("POST", "/v1/trainer/request", {})
            assert r.status == 200, r.text
            c.done("drain", 60)
            c.done("release", 120, tags=ALL_TAGS)
            c.done("grant", 30)
            # The trainer's lease, by its routes (the SDK's train() would wait in this thread for the grant).
            publish: dict[str, Any] = {"version": version}
            if kind == "disk":
                path = model.write(tmp / f"v{version}", seed)
                digest = checkpoint_digest(path, device="cuda")
                publish |= {"path": str(path), "digest": digest.wire()}
            else:
                digest = digest_named_tensors(weights.items(), ModelLayout("LlamaForCausalLM"))
            r = agent.trainer("POST", "/v1/trainer/publish", publish)
            assert r.status == 200, r.text
            if kind == "disk":
                refit = c.done("refit", 300, version=version, path=str(path))
            else:
                c.epoch += 1
                sent = agent.command("refit", c.epoch, wait=0, version=version, source="tensor")
                assert sent.status == 202, sent.text
                with handoff.refit_window(timeout=60) as window:
                    pushed = window.push_named_tensors(weights.items())
                refit = dict(
                    agent.wait_state(
                        lambda s, e=c.epoch: (
                            s["lastCommand"]["epoch"] == e and s["lastCommand"]["state"] != "Running"
                        ),
                        300,
                        "the tensor refit",
                    )["lastCommand"]
                )
            assert refit["state"] == "Succeeded", refit
            w = agent.state()["engine"]["weights"]
            assert w["version"] == version and w["checked"] == ["Trainer", "Previous"], w
            c.done("resume", 60)
            held, call_s = checker(server)
            assert not differing(held, digest.parameters), differing(held, digest.parameters)[:10]
            trainer_s = pushed.digest_seconds if kind == "tensor" else digest.seconds
            rec = {"iteration": i + 1, "kind": kind, "parameters": w["parameters"],
                   "checker_call_seconds": call_s, "agent_checker_seconds": w["checkerSeconds"],
                   "agent_check_seconds": w["seconds"], "trainer_digest_seconds": trainer_s,
                   "refit_seconds": refit["seconds"]}  # fmt: skip
            report.append(rec)
            rows.append([str(i + 1), kind, str(w["parameters"]), f"{call_s * 1e3:.1f}",
                         f"{w['checkerSeconds'] * 1e3:.1f}", f"{w['seconds'] * 1e3:.1f}",
                         f"{trainer_s * 1e3:.1f}", f"{refit['seconds'] * 1e3:.1f}"])  # fmt: skip
            del weights
        assert server.alive()
    finally:
        (results_dir / "verify_agent.log").write_text(agent.log_text()[-400_000:])
        agent.stop()
    table = markdown_table(
        ["iter", "refit", "parameters", "checker call ms", "agent: checker ms", "agent: whole check ms",
         "trainer digest ms", "refit ms"],
        rows,
    )  # fmt: skip
    (results_dir / "verify.json").write_text(
        json.dumps({"model": type(model).__name__, "iterations": report}, indent=1)
    )
    (results_dir / "verify.md").write_text(table + "\n")
    print(f"\nverified refits on real SGLang ({type(model).__name__}):\n{table}")
