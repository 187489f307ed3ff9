"""Real vLLM 0.26.0 on the GPU driven by the real agent (`--engine vllm`, `--gpu-probe nvml`): 3 iterations
(refit from disk, by tensor through the SDK's packing of vLLM's IPC weight transfer, from disk) with the
SGLang tier's checks (vllm_iterations.drive): release verified by the agent's probe, the prompt logprobs
after each refit equal to the trainer's transformers forward of the weights (LOGPROB_TOLERANCE), no prefix
cache hit after a refit for a prompt cached before it, and each agent command against vLLM's own calls in
the same run, the ratio printed (goal <= 1.05x). The model: RLJOB_GPU_MODEL (rljob.testing.gpu_models,
tiny by default; the logprob reference is computed for the tiny model only). Figures, written after each
iteration: $RLJOB_GPU_RESULTS_DIR/real_vllm.{json,md}.

Skipped, with the reason, without a GPU or without vLLM 0.26.0 unpacked (hack/real-vllm, docs/real-vllm.md).
With RLJOB_GPU_VLLM_STAND_IN=emulator the vLLM emulator and vllm_stand_in_trainer.py stand in for vLLM and
the torch trainer (no logprob check then): the harness proven on CPU."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import PY, Proc
from conftest import seconds_left
from real_vllm import IPC, VERSION, RealVllm, stand_in, start_phases, vllm_missing
from vllm_iterations import drive, table

from rljob.testing.gpu_models import spec_from_env

HERE = Path(__file__).resolve().parent
PLAN = ("disk", "tensor", "disk")
STAND_IN_PROBE = "rljob.emulator.probe:EmulatorProbe"
# Long enough to fill several of vLLM's 16-token KV blocks: only full blocks enter its prefix cache.
LONG_TEXT = " ".join(
    f"the model weights of rollout step {k} are kept in the cache of the engine" for k in range(6)
)


def cuda_missing() -> str | None:
    """conftest.gpu_missing less torch_memory_saver (SGLang's; vLLM sleeps through its own allocator)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # NVMLError or ImportError
        return f"NVML unavailable: {e}"
    return None


def why_not() -> str | None:
    if stand_in():
        return None
    return cuda_missing() or vllm_missing()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """vLLM serving version 0 of the model (its launch checkpoint), or the emulator standing in."""
    reason = why_not()
    if reason:
        pytest.skip(f"real-vLLM tier: {reason}")
    left = seconds_left()
    if left is not None and left < 120:
        pytest.skip(f"real-vLLM tier: {left:.0f} s left of RLJOB_GPU_TIMEOUT, too little to start vLLM")
    if stand_in():
        from vllm_procs import VllmEmulator, write_model

        launch = write_model(tmp_path / "v0", "0")
        emu = VllmEmulator(tmp_path, VERSION, *IPC, "--ipc-stand-in-dir", str(tmp_path / "ipc"), tps=300,
                           model=launch, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # fmt: skip
        try:
            emu.wait_ready(60)
            yield emu, launch
        finally:
            emu.stop()
        return
    from rljob.testing.gpu_models import load_model

    launch = load_model(spec_from_env()).write(tmp_path / "v0", seed=0)
    vllm = RealVllm(tmp_path, launch)
    vllm.note_memory()
    try:
        vllm.wait_ready()
        print(
            f"\nvLLM {VERSION} ready in {vllm.start_seconds:.1f} s: "
            + "; ".join(start_phases(vllm.log_text()))
        )
        yield vllm, launch
    finally:
        vllm.stop()


def prompt_ids(launch: Path) -> tuple[dict[str, list[int]], list[list[int]]]:
    """Fixed prompts (the logprob check), one cached prompt per iteration, the requests in flight."""
    if stand_in():
        from rljob.emulator import tokens

        def enc(text: str) -> list[int]:
            return list(tokens.encode(text))
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(launch / "tokenizer.json"))

        def enc(text: str) -> list[int]:
            return list(tok.encode(text).ids)

    prompts = {"fixed": enc("question: what is the capital of france? the capital of france is")}
    prompts |= {f"cached-{i}": enc(f"iteration {i}: " + LONG_TEXT)
                for i in range(1, len(PLAN) + 1)}  # fmt: skip
    return prompts, [enc(f"request {k} in flight") for k in range(3)]


def test_agent_drives_real_vllm(server: tuple[Any, Path], tmp_path: Path, results_dir: Path) -> None:
    vllm, launch = server
    prompts, flight = prompt_ids(launch)
    spec = spec_from_env()
    reference = not stand_in() and spec == "tiny"

    def trainer_argv(prompts_file: Path, result_dir: Path) -> list[str]:
        if stand_in():
            return [PY, str(HERE / "vllm_stand_in_trainer.py"), "--plan", ",".join(PLAN),
                    "--weights-dir", str(tmp_path / "ckpt"), "--ipc-dir", str(tmp_path / "ipc"),
                    "--result-dir", str(result_dir)]  # fmt: skip
        return [PY, str(HERE / "real_trainer.py"), "--plan", ",".join(PLAN), "--model", spec,
                "--model-dir", str(launch), "--weights-dir", str(tmp_path / "ckpt"), "--seed-base", "100",
                "--prompts", str(prompts_file), "--floor-bytes-file", str(tmp_path / "floor.json"),
                "--result-dir", str(result_dir)] + (["--reference"] if reference else [])  # fmt: skip

    def write(seen: dict[str, Any]) -> None:
        text, rows = table(seen)
        flags = " ".join(getattr(vllm, "flags", ()))
        head = f"vLLM {VERSION}{' (emulator stand-in)' if stand_in() else ''}, flags {flags}"
        (results_dir / "real_vllm.json").write_text(
            json.dumps({"seen": seen, "rows": rows}, indent=1, default=str)
        )
        (results_dir / "real_vllm.md").write_text(f"{head}\n\n{text}\n")

    if not stand_in():  # real_trainer.py's memory floor: what the release freed, written at the release
        (tmp_path / "floor.json").write_text(json.dumps({"bytes": 0}))
    procs: list[Proc] = []
    seen: dict[str, Any] = {"version": VERSION, "stand_in": stand_in(), "model": spec}
    probe = STAND_IN_PROBE if stand_in() else "nvml"
    try:
        drive(vllm, tmp_path, PLAN, procs, seen, trainer_argv, prompts, flight, probe, write, reference)
    finally:
        for p in procs:
            (results_dir / f"real_vllm_{p.name}.log").write_text(p.log_text()[-400_000:])
            p.stop()
        if not stand_in():
            (results_dir / "real_vllm_server.log").write_text(vllm.log_text()[-400_000:])
    write(seen)
    print("\n" + table(seen)[0])
    assert os.environ.get("RLJOB_GPU_VLLM_STAND_IN") in (None, "", "emulator")
