"""rljob.testing.tiny_model: the model the real-SGLang tier launches and refits, built here with no hub."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rljob.testing.tiny_model import TinyLlama, corpus, from_bf16, to_bf16

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_bf16_rounds_as_torch_does() -> None:
    values = np.random.default_rng(3).standard_normal(4096).astype(np.float32) * 7
    values[:4] = [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8]  # ties to even, both ways
    ours = to_bf16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(from_bf16(ours), torch.from_numpy(values).to(torch.bfloat16).float().numpy())


def test_checkpoints_differ_in_weights_only(tmp_path: Path) -> None:
    model = TinyLlama()
    a, b = model.write(tmp_path / "a", seed=0), model.write(tmp_path / "b", seed=1)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (
        model.write(tmp_path / "a2", seed=0).joinpath("model.safetensors").read_bytes()
        == (a / "model.safetensors").read_bytes()
    )


def test_transformers_loads_it_and_versions_are_nats_apart(tmp_path: Path) -> None:
    """A real architecture: transformers loads the checkpoint and its tokenizer, the weights are the bf16
    bits written, and two versions' logprobs for one prompt differ by far more than bf16 rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = TinyLlama()
    dirs = [model.write(tmp_path / f"v{seed}", seed=seed) for seed in (0, 1)]
    tok = AutoTokenizer.from_pretrained(dirs[0])
    config = json.loads((dirs[0] / "config.json").read_text())
    assert len(tok) == model.config.vocab_size == config["vocab_size"]
    ids = tok("the capital of france is paris. what model weights")["input_ids"]
    assert tok.decode(ids) == "the capital of france is paris. what model weights"
    logprobs = []
    for seed, d in zip((0, 1), dirs, strict=True):
        net = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        state = net.state_dict()
        for name, (shape, bits) in model.weights(seed).items():
            assert torch.equal(state[name].float(), torch.from_numpy(from_bf16(bits).reshape(shape))), name
        with torch.no_grad():
            out = torch.log_softmax(net(torch.tensor([ids])).logits.float(), -1)[0]
        logprobs.append(out[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
    assert float((logprobs[0] - logprobs[1]).abs().max()) > 1.0


def test_corpus_is_deterministic() -> None:
    assert corpus(50) == corpus(50)
