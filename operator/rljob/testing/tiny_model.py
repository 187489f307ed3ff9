"""A small real model for tests that run real SGLang, built here in seconds with no hub: a Llama
architecture (what `sglang.launch_server` and transformers load), random bf16 weights from a seed, and a
byte-level BPE tokenizer trained on a deterministic local corpus. Checkpoints of one `TinyLlama` differ
only in their weights (the tokenizer is the same file in each), so a refit from one to another is visible
in what SGLang generates.

    model = TinyLlama()
    launch = model.write(tmp / "v0", seed=0)          # a directory SGLang's --model-path takes
    v1 = model.write(tmp / "v1", seed=1)              # same shapes, other weights
    tensors = model.weights(seed=1)                   # {name: (shape, bf16 bytes as uint16)}

Needs numpy and `tokenizers` only (no torch): a checkpoint is written as safetensors by hand, in bf16."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

# The corpus the tokenizer is trained on: words of a fixed list and made-up words of fixed syllables, in
# an order a seeded RNG picks; rich enough that the BPE fills the whole vocabulary.
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "ta",
    "shi",
    "vo",
    "pe",
    "za",
    "gu",
    "de",
    "bi",
    "fo",
    "ly",
    "xe",
    "qua",
    "tro",
    "sen",
    "mar",
    "pol",
    "dun",
)
_WORDS = (
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "it",
    "at",
    "from",
    "be",
    "this",
    "which",
    "or",
    "are",
    "were",
    "not",
    "have",
    "has",
    "model",
    "weights",
    "rollout",
    "trainer",
    "release",
    "resume",
    "refit",
    "drain",
    "memory",
    "cache",
    "prefix",
    "token",
    "server",
    "gradient",
    "policy",
    "reward",
    "sample",
    "batch",
    "step",
    "version",
    "pod",
    "gang",
    "lease",
    "agent",
    "operator",
    "kubernetes",
    "cluster",
    "node",
    "GPU",
    "capital",
    "france",
    "paris",
    "sunny",
    "day",
    "like",
    "question",
    "answer",
    "what",
    "where",
    "when",
    "why",
    "how",
    "number",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "hundred",
    "thousand",
    "red",
    "green",
    "blue",
    "light",
    "dark",
    "fast",
    "slow",
    "small",
    "large",
)
CORPUS_LINES = 4000


@dataclass(frozen=True)
class TinyConfig:
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    # The model's vocabulary covers the token ids in tests/replays (recorded with Qwen's tokenizer, up to
    # 9707): real SGLang 0.5.15.post1 dies on an input id past it. The tokenizer learns `trained_vocab`
    # tokens and names the rest `<unused_N>`, so every id the model can sample decodes.
    vocab_size: int = 16384
    trained_vocab: int = 2048
    max_position_embeddings: int = 4096  # a prompt and 3,000 tokens fit: long requests stay in flight
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Logits of std ~3 (lm_head std 3/sqrt(hidden)): each version's distribution is peaked and far from
    # another version's, so logprobs tell versions apart by nats, not by rounding.
    lm_head_std: float = 3.0 / 16.0
    init_std: float = 0.05


def corpus(lines: int = CORPUS_LINES) -> list[str]:
    rng = random.Random(1234)

    def word() -> str:
        if rng.random() < 0.5:
            return rng.choice(_WORDS)
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))

    return [" ".join(word() for _ in range(rng.randint(4, 16))) + "." for _ in range(lines)]


def to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even as torch's cast rounds."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def write_safetensors_bf16(path: Path, tensors: dict[str, tuple[tuple[int, ...], np.ndarray]]) -> None:
    """The safetensors layout (8-byte little-endian header length, JSON header, raw data) with BF16
    tensors, which safetensors' numpy writer cannot express."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, (shape, bits) in tensors.items():
        data = np.ascontiguousarray(bits, dtype="<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


class TinyLlama:
    def __init__(self, config: TinyConfig | None = None) -> None:
        self.config = config or TinyConfig()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        head_dim = c.hidden_size // c.num_attention_heads
        kv = c.num_key_value_heads * head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (c.hidden_size, c.hidden_size),
                p + "self_attn.k_proj.weight": (kv, c.hidden_size),
                p + "self_attn.v_proj.weight": (kv, c.hidden_size),
                p + "self_attn.o_proj.weight": (c.hidden_size, c.hidden_size),
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                p + "input_layernorm.weight": (c.hidden_size,),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
            }
        return shapes | {
            "model.norm.weight": (c.hidden_size,),
            "lm_head.weight": (c.vocab_size, c.hidden_size),
        }

    def weights(self, seed: int) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
        """Every parameter as (shape, bf16 bits): norms near 1, lm_head wide, the rest init_std."""
        rng = np.random.default_rng(seed)
        out: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
        for name, shape in self.shapes().items():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * rng.standard_normal(shape)
            elif name == "lm_head.weight":
                values = self.config.lm_head_std * rng.standard_normal(shape)
            else:
                values = self.config.init_std * rng.standard_normal(shape)
            out[name] = (shape, to_bf16(values.astype(np.float32)))
        return out

    def hf_config(self) -> dict[str, Any]:
        c = asdict(self.config)
        for key in ("lm_head_std", "init_std", "trained_vocab"):
            c.pop(key)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **c,
            "hidden_act": "silu",
            "head_dim": self.config.hidden_size // self.config.num_attention_heads,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.config.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
            "initializer_range": self.config.init_std,
            "use_cache": True,
        }

    @cached_property
    def tokenizer_json(self) -> str:
        """A byte-level BPE trained on `corpus()`: the same text, the same tokenizer."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=self.config.trained_vocab,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus(), trainer=trainer)
        doc = json.loads(tok.to_str())
        vocab = doc["model"]["vocab"]
        if len(vocab) > self.config.vocab_size:
            raise ValueError(f"tokenizer has {len(vocab)} tokens > vocab {self.config.vocab_size}")
        vocab |= {f"<unused_{i}>": i for i in range(len(vocab), self.config.vocab_size)}
        return json.dumps(doc, ensure_ascii=False)

    def write(self, directory: Path, seed: int) -> Path:
        """A checkpoint directory: config.json, model.safetensors (bf16), the tokenizer files."""
        self.write_config(directory)
        write_safetensors_bf16(directory / "model.safetensors", self.weights(seed))
        return directory

    def write_config(self, directory: Path) -> None:
        """Everything of a checkpoint directory but the weights: config.json, the tokenizer files."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.hf_config(), indent=1))
        (directory / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False})
        )
        (directory / "tokenizer.json").write_text(self.tokenizer_json)
        (directory / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "pad_token": "</s>",
                    "model_max_length": self.config.max_position_embeddings,
                    "clean_up_tokenization_spaces": False,
                }
            )
        )
