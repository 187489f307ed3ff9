"""How the fake kubelet runs an RLJob's pods on a GPU machine (`machine_mapping`), and the CPU stand-in of the
same pods (`stand_in_mapping`).

`machine_mapping()`: every container runs its own command on this machine. The agent is the real agent with
the args and env the operator generated (as `rljob_mapping` runs it, at the product's sampling period); the
`sglang` container runs its own `python3 -m sglang.launch_server ...` and the trainer its own command, each
with `python`/`python3` replaced by this interpreter (whose PYTHONPATH the kubelet passes on) and with this
machine's GPU runtime variables (`CUDA_*`, `NVIDIA_*`, `LD_LIBRARY_PATH`, `TRITON_*`, ...), which a GPU
container gets from its image. As for every simulated pod, 127.0.0.1 in args and env is the pod's own
loopback address (pods.py), so SGLang listens on the pod IP at the port of its flags.

`stand_in_mapping(emulator_args, trainer_args)`: the same pods where there is no GPU: the SGLang emulator
with the `sglang` container's launch flags (and `emulator_args`), or the vLLM emulator with a vLLM
container's `vllm serve` flags, the simulated trainer
(`rljob.testing.trainer`, `trainer_args`) for the trainer. It exists to prove a GPU test's harness on CPU
and is chosen explicitly (tests/gpu/README.md); nothing falls back to it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

from rljob.testing.kubelet import ContainerContext, Launch, Mapping
from rljob.testing.pods import TRAINER_ENTRY, classify, pod_loopback

# This machine's variables a GPU container would have from its image (its driver, CUDA and caches).
GPU_RUNTIME_PREFIXES = (
    "CUDA_", "NVIDIA_", "NCCL_", "TRITON_", "TORCH_", "TORCHINDUCTOR_", "FLASHINFER_", "HF_", "TRANSFORMERS_",
    "TOKENIZERS_", "XDG_",
)  # fmt: skip
GPU_RUNTIME_NAMES = ("LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "CC", "CXX", "OMP_NUM_THREADS")
_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def gpu_runtime_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k in GPU_RUNTIME_NAMES or k.startswith(GPU_RUNTIME_PREFIXES)}


def on_this_interpreter(argv: Sequence[str]) -> list[str]:
    """A command whose program is `python`/`python3[.N]` run by this interpreter, unbuffered."""
    if argv and _PYTHON.fullmatch(os.path.basename(argv[0])):
        return [sys.executable, "-u", *argv[1:]]
    return list(argv)


def _agent(ctx: ContainerContext) -> Launch:
    c = classify(ctx)
    return Launch([sys.executable, "-u", "-m", "rljob.agent.main", *c.args], env=c.env)


def machine_mapping() -> Mapping:
    """Each container's own command on this machine (the module docstring)."""

    def mapping(ctx: ContainerContext) -> Launch:
        c = classify(ctx)
        if c.kind == "agent":
            return _agent(ctx)
        argv = on_this_interpreter([pod_loopback(a, ctx.pod_ip) for a in ctx.argv()])
        return Launch(argv, env={**gpu_runtime_env(), **c.env, "PYTHONUNBUFFERED": "1"})

    return mapping


def stand_in_mapping(
    emulator_args: Sequence[str] = (), trainer_args: Sequence[str] = (), trainer: str = "trainer"
) -> Mapping:
    """The emulator for SGLang and the simulated trainer for the container named `trainer` (the module
    docstring)."""

    def mapping(ctx: ContainerContext) -> Launch:
        c = classify(ctx, emulator_args)
        if c.kind == "agent":
            return _agent(ctx)
        if c.kind == "sglang":
            return Launch([sys.executable, "-u", "-m", "rljob.emulator", *c.args], env=c.env)
        if c.kind == "vllm":
            return Launch([sys.executable, "-u", "-m", "rljob.emulator.vllm", *c.args], env=c.env)
        if ctx.name == trainer:
            args = [pod_loopback(ctx.remap(a), ctx.pod_ip) for a in trainer_args]
            return Launch([sys.executable, "-u", "-m", TRAINER_ENTRY, *args], env=c.env)
        return Launch(c.args, env=c.env)

    return mapping
