"""rljob.trainer.engines.sglang.digest: a checkpoint's tensors mapped to SGLang's parameters as its Llama
loader maps them (…/models/llama.py:628-700@0.5.15.post1), and the emulator's /weights_checker answering the
same hashes for the same checkpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from rljob.testing.tiny_model import TinyConfig, TinyLlama, write_safetensors_bf16
from rljob.trainer.engines.sglang import tensor_hash as th
from rljob.trainer.engines.sglang.digest import (
    ModelLayout,
    checkpoint_digest,
    digest_named_tensors,
    plan,
)

LLAMA = ModelLayout("LlamaForCausalLM")


def test_qkv_and_gate_up_are_fused_in_the_loaders_order() -> None:
    names = [
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.norm.weight",
    ]
    whole, partial = plan(names, LLAMA)
    assert whole == {
        "model.layers.0.self_attn.qkv_proj.weight": [names[1], names[2], names[0]],
        "model.layers.0.mlp.gate_up_proj.weight": [names[4], names[3]],
        "model.norm.weight": ["model.norm.weight"],
    }
    assert partial == []
    assert plan(names[:2], LLAMA) == ({}, ["model.layers.0.self_attn.qkv_proj.weight"])
    tied = ModelLayout("LlamaForCausalLM", tie_word_embeddings=True)
    assert plan(["lm_head.weight", "model.embed_tokens.weight"], tied)[0] == {
        "model.embed_tokens.weight": ["model.embed_tokens.weight"]
    }


def test_a_fused_parameter_is_its_parts_hashed_back_to_back() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.integers(0, 2**16, (8, 4), dtype=np.uint16) for _ in range(3))
    named = [
        ("model.layers.0.self_attn.k_proj.weight", k),
        ("model.layers.0.self_attn.q_proj.weight", q),
        ("model.layers.0.self_attn.v_proj.weight", v),
    ]
    d = digest_named_tensors(named, LLAMA)
    fused = np.concatenate([q, k, v]).tobytes()
    assert d.parameters == {"model.layers.0.self_attn.qkv_proj.weight": th.hex16(th.hash_bytes(fused))}


def test_the_vocabulary_is_padded_to_64_rows_of_zeros() -> None:
    """VocabParallelEmbedding pads its rows to a multiple of 64 and fills the padding with 0
    (…/layers/vocab_parallel_embedding.py:45,499@0.5.15.post1)."""
    emb = np.arange(100 * 4, dtype=np.uint16).reshape(100, 4)
    d = digest_named_tensors([("model.embed_tokens.weight", emb), ("lm_head.weight", emb)], LLAMA)
    padded = np.concatenate([emb, np.zeros((28, 4), dtype=np.uint16)]).tobytes()
    want = th.hex16(th.hash_bytes(padded))
    assert d.parameters == {"model.embed_tokens.weight": want, "lm_head.weight": want}


def test_where_the_sdk_cannot_reproduce_sglang_it_says_why() -> None:
    assert "not known to the SDK" in str(
        digest_named_tensors([], ModelLayout("Qwen3MoeForCausalLM")).unavailable
    )
    quant = ModelLayout.from_config(
        {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "fp8"}}
    )
    assert "quantized (fp8)" in str(digest_named_tensors([], quant).unavailable)
    assert "architecture is not known" in str(digest_named_tensors([], ModelLayout(None)).unavailable)
    assert digest_named_tensors([], ModelLayout(None)).wire() == {
        "unavailable": "the model's architecture is not known (no `architectures` in its config)"
    }


def test_a_checkpoint_on_disk_and_its_tensors_give_one_digest(tmp_path: Path) -> None:
    model = TinyLlama(TinyConfig(hidden_size=64, intermediate_size=96, vocab_size=100, trained_vocab=64))
    weights = model.weights(seed=3)
    (tmp_path / "config.json").write_text(json.dumps(model.hf_config()))
    write_safetensors_bf16(tmp_path / "model.safetensors", weights)
    on_disk = checkpoint_digest(tmp_path)
    named = [(n, bits.reshape(shape)) for n, (shape, bits) in weights.items()]
    assert on_disk.unavailable is None
    assert (
        on_disk.parameters
        == digest_named_tensors(named, ModelLayout.from_config(model.hf_config())).parameters
    )
    assert len(on_disk.parameters) == 1 + 6 * 2 + 2  # embed, 6 per layer, norm, lm_head


def test_the_torch_digest_is_the_numpy_one(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model = TinyLlama(TinyConfig(hidden_size=64, intermediate_size=96, vocab_size=100, trained_vocab=64))
    weights = model.weights(seed=4)
    as_numpy = [(n, bits.reshape(shape)) for n, (shape, bits) in weights.items()]
    as_torch = [(n, torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16)) for n, a in as_numpy]
    assert (
        digest_named_tensors(as_torch, LLAMA).parameters == digest_named_tensors(as_numpy, LLAMA).parameters
    )


def test_the_emulator_holds_what_the_digest_says(tmp_path: Path) -> None:
    """The emulator's /weights_checker after launching from a checkpoint: the digest's hashes, parameter by
    parameter (both map names and hash bytes as SGLang does; real SGLang: tests/gpu)."""
    from rljob.emulator.config import parse_config
    from rljob.emulator.engine import Engine
    from rljob.emulator.memory import make_backend
    from rljob.emulator.weight_updater import WeightUpdater

    launch = TinyLlama(TinyConfig(hidden_size=64, intermediate_size=96, vocab_size=100, trained_vocab=64))
    directory = tmp_path / "v0"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(launch.hf_config()))
    write_safetensors_bf16(directory / "model.safetensors", launch.weights(seed=0))
    cfg = parse_config(["--model-path", str(directory), "--sglang-version", "0.5.15.post1"])

    async def checker() -> tuple[int, dict]:  # type: ignore[type-arg]
        return WeightUpdater(Engine(cfg, make_backend(cfg))).weights_checker({"action": "checksum"})

    status, body = asyncio.run(checker())
    assert status == 200 and body["success"] is True
    (rank,) = body["ranks"]
    assert rank["checksums"] == checkpoint_digest(directory).parameters
    assert rank["parallelism_info"]["tp_size"] == 1
