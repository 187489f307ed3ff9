"""rljob.testing.llama_checkpoint: Llama-3-8B's config and shard layout, and, at a scaled-down shape on the
CPU, what the GPU tier relies on: versions share the layer shards as hard links, the files hold what
`tensors()` returns, transformers loads the config, tokenizer and weights, and two versions' logits
differ."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rljob.testing.llama_checkpoint import INDEX, LLAMA3_8B, ShardedLlama
from rljob.testing.tiny_model import TinyConfig

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

SMALL = TinyConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    trained_vocab=512,
    max_position_embeddings=256,
    rope_theta=500000.0,
    lm_head_std=3.0 / 8,
    init_std=0.02,
)


def test_the_8b_config_is_llama_3_8b(tmp_path: Path) -> None:
    ckpt = ShardedLlama(tmp_path, LLAMA3_8B)
    config = ckpt.model.hf_config()
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")} == {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
    }
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert config["vocab_size"] == 128256 and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert config["rope_theta"] == 500000.0 and config["torch_dtype"] == "bfloat16"
    assert ckpt.nbytes == 16_060_522_496  # 8.03 B parameters in bf16
    # four layer shards of 8 layers, then the version shard: embedding, final norm, lm_head
    assert list(ckpt.shards) == [f"model-0000{k}-of-00005.safetensors" for k in range(1, 6)]
    assert [len(names) for names in ckpt.shards.values()] == [72, 72, 72, 72, 3]
    assert ckpt.version_tensors() == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[ShardedLlama, Path, Path]:
    root = tmp_path_factory.mktemp("llama")
    ckpt = ShardedLlama(root, SMALL, layers_per_shard=2)
    return ckpt, ckpt.write(root / "v0", seed=0, device="cpu"), ckpt.write(root / "v1", seed=1, device="cpu")


def test_versions_hard_link_the_layer_shards_and_write_their_own(
    written: tuple[ShardedLlama, Path, Path],
) -> None:
    ckpt, v0, v1 = written
    assert list(ckpt.shards)[-1] == ckpt.version_shard == "model-00004-of-00004.safetensors"
    for shard in ckpt.shards:
        a, b = os.stat(v0 / shard), os.stat(v1 / shard)
        if shard == ckpt.version_shard:
            assert a.st_ino != b.st_ino and (v0 / shard).read_bytes() != (v1 / shard).read_bytes()
        else:
            assert a.st_ino == b.st_ino == os.stat(ckpt.base / shard).st_ino and a.st_nlink == 3
    for name in (INDEX, "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.samefile(v0 / name, v1 / name)
    assert ckpt.write(v1, seed=1, device="cpu") == v1  # written again: the same files
    assert os.stat(v1 / "model-00001-of-00004.safetensors").st_nlink == 3


def test_the_index_and_the_shards_hold_every_tensor_of_the_version_once(
    written: tuple[ShardedLlama, Path, Path],
) -> None:
    ckpt, _, v1 = written
    weight_map = json.loads((v1 / INDEX).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(ckpt.shapes)
    expected = ckpt.tensors(seed=1, device="cpu")
    seen = set()
    for shard in ckpt.shards:
        loaded = safetensors_torch.load_file(v1 / shard)
        assert sorted(loaded) == sorted(n for n, s in weight_map.items() if s == shard)
        for name, t in loaded.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, expected[name]), name
            seen.add(name)
    assert seen == set(ckpt.shapes)
    assert json.loads((v1 / INDEX).read_text())["metadata"]["total_size"] == ckpt.nbytes


def test_a_version_changes_the_version_shard_only(written: tuple[ShardedLlama, Path, Path]) -> None:
    ckpt, _, _ = written
    a, b = ckpt.tensors(seed=0, device="cpu"), ckpt.tensors(seed=1, device="cpu")
    for name in ckpt.shapes:
        assert torch.equal(a[name], b[name]) == (name not in ckpt.version_tensors()), name
    assert torch.equal(ckpt.tensors(seed=1, device="cpu")["lm_head.weight"], b["lm_head.weight"])


def test_transformers_loads_it_and_a_refit_moves_the_logits(written: tuple[ShardedLlama, Path, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    _, v0, v1 = written
    config = transformers.AutoConfig.from_pretrained(v0)
    assert (config.hidden_size, config.num_key_value_heads, config.vocab_size) == (64, 2, 4096)
    tok = transformers.AutoTokenizer.from_pretrained(v0)
    assert len(tok) == SMALL.vocab_size
    ids = tok("question: what is the capital of france?")["input_ids"]
    assert len(ids) > 0 and max(ids) < SMALL.vocab_size

    def logprobs(directory: Path) -> torch.Tensor:
        net = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            return torch.log_softmax(net(torch.tensor([ids])).logits[0], dim=-1)

    assert float((logprobs(v0) - logprobs(v1)).abs().max()) > 1.0
