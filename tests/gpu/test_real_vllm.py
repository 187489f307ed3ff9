"""Real vLLM 0.26.0 on the GPU driven by the real agent (`--engine vllm`, `--gpu-probe nvml`): 3 iterations
(refit from disk, by tensor through the SDK's packing of vLLM's IPC weight transfer, from disk) with the
SGLang tier's checks (vllm_iterations.drive): release verified by the agent's probe, the prompt logprobs
after each refit equal to the trainer's transformers forward of the weights (LOGPROB_TOLERANCE), no prefix
cache hit after a refit for a prompt cached before it, and each agent command against vLLM's own calls in
the same run, the ratio printed (goal <= 1.05x). The model: RLJOB_GPU_MODEL (rljob.testing.gpu_models,
tiny by default; the logprob reference is computed for the tiny model only). Figures, written after each
iteration: $RLJOB_GPU_RESULTS_DIR/real_vllm.{json,md}.

test_differential, after it in the same vLLM launch: every sequence of tests/differential/vllm/sequences.json
and tests/replays/vllm, each from the stated state (rljob.testing.vllm_differential.RESET, which also
brings back a server the iterations left paused or asleep), to real vLLM and to the emulator at 0.26.0; the
real answers are written to $RLJOB_GPU_RESULTS_DIR/vllm/real-0.26.0.json (committed as
tests/differential/vllm/real-0.26.0.json, which tests/agent/test_vllm_differential.py holds the emulator
to in CI), the emulator's beside it, and the differences table to vllm/differential.md. The IPC updates
carry real CUDA tensors of this process (vllm_differential.real_builders).

Skipped, with the reason, without a GPU or without vLLM 0.26.0 unpacked (hack/real-vllm, docs/real-vllm.md).
With RLJOB_GPU_VLLM_STAND_IN=emulator the vLLM emulator and vllm_stand_in_trainer.py stand in for vLLM and
the torch trainer (no logprob check then): the harness proven on CPU; a recording made so says
`stand_in`, and the CPU test refuses it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import PY, Proc
from conftest import seconds_left
from gpu_helpers import cuda_missing
from real_vllm import ENV, IPC, LAUNCH_FLAGS, VERSION, RealVllm, stand_in, start_phases, vllm_missing
from vllm_iterations import drive, table

from rljob.testing import differential, vllm_differential
from rljob.testing.gpu_models import spec_from_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DIFFERENTIAL = ROOT / "tests" / "differential" / "vllm"
EMULATOR_TPS = 300  # the emulator's tokens per second per request in the differential
STAND_IN_FLAGS = ("--enable-sleep-mode", *IPC)  # the stand-in's launch (VllmEmulator adds sleep mode)
PLAN = ("disk", "tensor", "disk")
STAND_IN_PROBE = "rljob.emulator.probe:EmulatorProbe"
# Long enough to fill several of vLLM's 16-token KV blocks: only full blocks enter its prefix cache.
LONG_TEXT = " ".join(
    f"the model weights of rollout step {k} are kept in the cache of the engine" for k in range(6)
)


def why_not() -> str | None:
    if stand_in():
        return None
    return cuda_missing() or vllm_missing()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, Path]]:
    """vLLM serving version 0 of the model (its launch checkpoint), or the emulator standing in; one
    launch for the module's tests, with its folder."""
    reason = why_not()
    if reason:
        pytest.skip(f"real-vLLM tier: {reason}")
    left = seconds_left()
    if left is not None and left < 120:
        pytest.skip(f"real-vLLM tier: {left:.0f} s left of RLJOB_GPU_TIMEOUT, too little to start vLLM")
    tmp_path = tmp_path_factory.mktemp("real-vllm")
    if stand_in():
        from vllm_procs import VllmEmulator, write_model

        launch = write_model(tmp_path / "v0", "0")
        emu = VllmEmulator(tmp_path, VERSION, *IPC, "--ipc-stand-in-dir", str(tmp_path / "ipc"), tps=300,
                           model=launch, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # fmt: skip
        try:
            emu.wait_ready(60)
            yield emu, launch, tmp_path
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
        yield vllm, launch, tmp_path
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


def test_agent_drives_real_vllm(server: tuple[Any, Path, Path], results_dir: Path) -> None:
    vllm, launch, tmp_path = server
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


# --- the emulator held to real vLLM ---------------------------------------------------------------------


def test_differential(server: tuple[Any, Path, Path], results_dir: Path) -> None:
    """Second in the module, in the same launch: every sequence to the emulator (launched as this vLLM,
    on the same checkpoint) and to this vLLM, each from the stated state; the recording, the emulator's
    answers and the table of their differences go to $RLJOB_GPU_RESULTS_DIR/vllm/."""
    vllm, launch, tmp = server
    doc = json.loads((DIFFERENTIAL / "sequences.json").read_text())
    assert (tuple(doc["launch"]["vllm_args"]), doc["launch"]["vllm_env"]) == (LAUNCH_FLAGS, ENV), (
        "tests/differential/vllm/sequences.json states another launch than real_vllm.py's"
    )
    left = seconds_left()
    if left is not None and left < 240:
        pytest.skip(f"real-vLLM differential: {left:.0f} s left of RLJOB_GPU_TIMEOUT")
    from vllm_procs import VllmEmulator

    sequences = vllm_differential.load_sequences(
        DIFFERENTIAL / "sequences.json", ROOT / "tests" / "replays" / "vllm"
    )
    engine = vllm_differential.VLLM
    emu = VllmEmulator(tmp, VERSION, *doc["launch"]["vllm_args"], sleep_mode=False, tps=EMULATOR_TPS,
                       model=launch, env=doc["launch"]["vllm_env"])  # fmt: skip
    try:
        emu.wait_ready(60)
        emu_ctx = vllm_differential.contexts(tmp / "diff-emu", launch)
        emulated = differential.run_all(emu.url, emu.alive, sequences, VERSION, emu_ctx, True, engine)
    finally:
        emu.stop()
    builders = vllm_differential.stand_in_builders if stand_in() else vllm_differential.real_builders
    real_ctx = vllm_differential.contexts(tmp / "diff-real", launch, builders(launch))
    real = differential.run_all(vllm.url, vllm.alive, sequences, VERSION, real_ctx, True, engine)
    record = {
        "version": VERSION,
        **({"stand_in": "the vLLM emulator (RLJOB_GPU_VLLM_STAND_IN=emulator)"} if stand_in() else {}),
        "launch_flags": list(STAND_IN_FLAGS if stand_in() else vllm.flags),
        "env": dict(doc["launch"]["vllm_env"]),
        "model": "stand-in" if stand_in() else spec_from_env(),
        "emulator_tps": EMULATOR_TPS,
        "reset": vllm_differential.RESET_STATE,
        "sequences": real,
    }
    out = results_dir / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"real-{VERSION}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"emulator-{VERSION}.json").write_text(json.dumps({"sequences": emulated}, indent=1) + "\n")
    text = differential.table(
        real, emulated, differential.recorded(DIFFERENTIAL / "known-differences.json"), "vLLM"
    )
    (out / "differential.md").write_text(text)
    print("\n" + text)
    assert [o["name"] for o in real] == [s["name"] for s in sequences], "a sequence was not sent"
    assert vllm.alive()
