"""rljob.testing.model_trainer (the GPU loop's torch trainer) on CPU: its loop against the real agent and the
emulator, a test conductor standing in for the operator. A disk refit only (a tensor refit pushes CUDA
tensors) and the weights on the CPU (--device cpu); on a GPU, tests/gpu/test_operator_loop.py runs it."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import PY, Agent, Emulator, Proc
from test_sim_trainer import conduct

from rljob.testing.model_trainer import CHECK_PROMPTS
from rljob.testing.rollout_gate import GateKeeper
from rljob.testing.tiny_model import TinyLlama

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="model_trainer needs torch and transformers",
)
ITERATIONS = 2


def test_model_trainer_publishes_checkpoints_and_the_last_reference(
    tmp_path: Path,
    procs: list[Proc],
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
) -> None:
    launch = TinyLlama().write(tmp_path / "base", seed=0)
    emu = start_emulator("0.5.15.post1", "--weight-version", "0", "--enable-metrics", tps=300)
    agent = start_agent(emu)
    edges: list[tuple[int, str]] = []
    keeper = GateKeeper(tmp_path / "gate", lambda i, edge: edges.append((i, edge))).start()
    seen: list[dict[str, object]] = []
    conductor = threading.Thread(target=conduct, args=(agent, "disk", ITERATIONS, seen), daemon=True)
    conductor.start()
    weights = tmp_path / "weights"
    env = {
        "RLJOB_AGENT_URL": agent.trainer_url,
        "RLJOB_ENGINE_SERVER_URL": emu.url,
        "RLJOB_REFIT_SOURCE": "disk",
        "RLJOB_WEIGHTS_DIR": str(weights),
    }
    argv = [
        PY, "-m", "rljob.testing.model_trainer", "--model-path", str(launch), "--device", "cpu",
        "--iterations", str(ITERATIONS), "--prompts", "2", "--samples-per-prompt", "2",
        "--max-new-tokens", "8", "--gate-dir", str(tmp_path / "gate"), "--timeout", "120",
    ]  # fmt: skip
    trainer = Proc("model-trainer", argv, tmp_path / "model-trainer.log", env)
    procs.append(trainer)
    try:
        assert trainer.wait_exit(240) == 0, trainer.log_text()[-4000:]
    finally:
        keeper.stop()
    conductor.join(30)
    assert edges == [(1, "start"), (1, "end"), (2, "start"), (2, "end")] and not keeper.errors
    st = agent.state()
    assert st["engine"]["servedVersion"] == "2" and st["engine"]["modelPath"] == str(weights / "v2")
    assert (weights / "v1" / "model.safetensors").is_file() and (weights / "v2" / "config.json").is_file()
    published = [json.loads(x) for x in trainer.log_text().splitlines() if '"published"' in x]
    assert [p["version"] for p in published] == ["1", "2"] and all(
        p["held_at_publish"] == 0 for p in published
    )
    assert not (weights / "reference-v1.json").exists()  # the last version's only
    reference = json.loads((weights / "reference-v2.json").read_text())
    assert set(reference) == set(CHECK_PROMPTS)
    for ref in reference.values():
        assert len(ref["input_logprobs"]) == len(ref["input_ids"]) - 1 > 3
        assert all(lp <= 0 for lp in ref["input_logprobs"]) and ref["next_logprob"] <= 0
        assert 0 <= ref["next_token"] < TinyLlama().config.vocab_size
        assert len(ref["top"]) == 5 and ref["top"][0] == [ref["next_token"], ref["next_logprob"]]
