"""Llama checkpoints of the size users run, for real SGLang on a GPU, built there in seconds with no hub:
Llama-3-8B's shapes (`LLAMA3_8B`: 32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
vocabulary 128256, rope theta 500000) with random bf16 weights generated on the GPU, the config.json and
tokenizer of rljob.testing.tiny_model (its BPE tokenizer, padded to the model's vocabulary so that every
id decodes), written as safetensors shards with an index.

Versions share every file but one: `base/` holds the layer shards, the index, the config and tokenizer,
written once; a version directory hard-links them and writes only its version shard (the embedding,
lm_head and the final norm, 2.1 GB at 8B), so a further version costs seconds, and a refit to it changes
every logit.

    ckpt = ShardedLlama(root)                        # root/base: written by the first write()
    v0 = ckpt.write(root / "v0", seed=0)             # a directory SGLang's --model-path takes
    weights = ckpt.tensors(seed=1, device="cuda")    # version 1's weights, as write(..., seed=1) writes them

Each tensor is drawn from a generator of its own (seeded by the version and its name), so the same
version's tensors are the same bytes whichever process makes them on the same kind of device.

`llama3_8b()` is the same with its root from RLJOB_LLAMA_CHECKPOINT_ROOT: a factory with no arguments,
for a process that names its model as `module:attr`.

    python -m rljob.testing.llama_checkpoint --root DIR --seeds 0[,1,...] [--device cuda] [--out FILE]

prints (and writes to FILE) the timings of the build as JSON. Needs torch; imported only when run."""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any

from rljob.testing.tiny_model import TinyConfig, TinyLlama

# Logits of std ~3, as the tiny model's: lm_head std 3/sqrt(hidden), each version's distribution peaked and
# far from another's.
LLAMA3_8B = TinyConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    lm_head_std=3.0 / 64,
    init_std=0.02,
)
LAYERS_PER_SHARD = 8  # four layer shards of ~3.5 GB at 8B, written side by side
ROOT_ENV = "RLJOB_LLAMA_CHECKPOINT_ROOT"
DEFAULT_ROOT = "/tmp/rljob-llama3-8b"
INDEX = "model.safetensors.index.json"
COMPLETE = "complete.json"  # written last into base/: its presence says base/ is whole
DTYPES = {"bfloat16": "BF16", "float32": "F32"}


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor of one version."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def write_shard(path: Path, tensors: dict[str, Any]) -> dict[str, float]:
    """The safetensors layout (8-byte little-endian header length, JSON header, raw data), each tensor
    copied to host memory and written in turn (never the whole shard in memory); renamed into place when
    complete. Returns the seconds spent copying to the host and writing."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        dtype = DTYPES[str(t.dtype).removeprefix("torch.")]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    partial = path.with_name(path.name + ".partial")
    spent = {"copy_s": 0.0, "write_s": 0.0}
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            t0 = time.perf_counter()
            raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            t1 = time.perf_counter()
            f.write(raw)
            spent["copy_s"] += t1 - t0
            spent["write_s"] += time.perf_counter() - t1
    partial.replace(path)
    return spent


class ShardedLlama:
    """The versions of one Llama checkpoint under `root`: the shared files in root/base, a version per
    directory. `base_seed` draws the layers every version shares."""

    def __init__(
        self,
        root: Path,
        config: TinyConfig = LLAMA3_8B,
        base_seed: int = 0,
        layers_per_shard: int = LAYERS_PER_SHARD,
    ) -> None:
        self.root = Path(root)
        self.config = config
        self.model = TinyLlama(config)
        self.base_seed = base_seed
        self.shapes = self.model.shapes()
        layers = config.num_hidden_layers
        groups = [range(k, min(layers, k + layers_per_shard)) for k in range(0, layers, layers_per_shard)]
        total = len(groups) + 1
        self.shards: dict[str, list[str]] = {}
        for k, group in enumerate(groups):
            prefixes = tuple(f"model.layers.{i}." for i in group)
            self.shards[f"model-{k + 1:05d}-of-{total:05d}.safetensors"] = [
                n for n in self.shapes if n.startswith(prefixes)
            ]
        self.version_shard = f"model-{total:05d}-of-{total:05d}.safetensors"
        self.shards[self.version_shard] = [n for n in self.shapes if not n.startswith("model.layers.")]
        self.timings: list[dict[str, Any]] = []  # one entry per write: where its seconds went

    @property
    def base(self) -> Path:
        return self.root / "base"

    @cached_property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * 2 for shape in self.shapes.values())

    def version_tensors(self) -> list[str]:
        return self.shards[self.version_shard]

    def tensor(self, name: str, seed: int, device: str = "cuda") -> Any:
        """One tensor of version `seed` (a layer tensor is the base's, whatever the version)."""
        import torch

        c = self.config
        if name not in self.shards[self.version_shard]:
            seed = self.base_seed
        g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
        t = torch.empty(self.shapes[name], dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            return t.normal_(1.0, 0.1, generator=g)
        std = c.lm_head_std if name == "lm_head.weight" else c.init_std
        return t.normal_(0.0, std, generator=g)

    def tensors(self, seed: int, device: str = "cuda") -> dict[str, Any]:
        """Every tensor of version `seed`, in the order of the model's parameters."""
        return {name: self.tensor(name, seed, device) for name in self.shapes}

    def cuda_weights(self, seed: int) -> dict[str, Any]:
        return self.tensors(seed, device="cuda")

    def write_base(self, device: str = "cuda") -> Path:
        """root/base, once: the layer shards (side by side, each generated on `device`), the index, the
        config and tokenizer."""
        done = self.base / COMPLETE
        if done.exists():
            return self.base
        self.base.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        layer_shards = [s for s in self.shards if s != self.version_shard]
        with ThreadPoolExecutor(max_workers=len(layer_shards)) as pool:
            parts = list(pool.map(lambda s: self._write_generated(self.base / s, s, self.base_seed, device),
                                  layer_shards))  # fmt: skip
        weight_map = {name: shard for shard, names in self.shards.items() for name in names}
        index = {"metadata": {"total_size": self.nbytes}, "weight_map": weight_map}
        (self.base / INDEX).write_text(json.dumps(index, indent=1))
        self.model.write_config(self.base)
        record = {"what": "base", "seconds": time.perf_counter() - started, "shards": parts}
        self.timings.append(record)
        done.write_text(json.dumps(record))
        return self.base

    def write(self, directory: Path, seed: int, device: str = "cuda") -> Path:
        """Version `seed` as a checkpoint directory: the base's files hard-linked, its version shard
        written."""
        self.write_base(device)
        started = time.perf_counter()
        directory.mkdir(parents=True, exist_ok=True)
        for src in self.base.iterdir():
            if src.name == COMPLETE:
                continue
            dst = directory / src.name
            if dst.exists() and not os.path.samefile(src, dst):
                dst.unlink()
            if not dst.exists():
                os.link(src, dst)
        part = self._write_generated(directory / self.version_shard, self.version_shard, seed, device)
        self.timings.append({"what": f"version {seed}", "seconds": time.perf_counter() - started, **part})
        return directory

    def _write_generated(self, path: Path, shard: str, seed: int, device: str) -> dict[str, Any]:
        import torch

        t0 = time.perf_counter()
        tensors = {name: self.tensor(name, seed, device) for name in self.shards[shard]}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        generated = time.perf_counter() - t0
        spent = write_shard(path, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"shard": shard, "bytes": nbytes, "generate_s": generated, **spent}


def llama3_8b() -> ShardedLlama:
    """The Llama-3-8B-shaped checkpoints under $RLJOB_LLAMA_CHECKPOINT_ROOT (default /tmp/rljob-llama3-8b)."""
    return ShardedLlama(Path(os.environ.get(ROOT_ENV, DEFAULT_ROOT)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljob.testing.llama_checkpoint", description=__doc__)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--seeds", default="0", help="versions to write, comma-separated: ROOT/v<seed>")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, help="the timings as JSON, also printed")
    args = p.parse_args(argv)
    ckpt = ShardedLlama(args.root)
    started = time.perf_counter()
    for seed in (int(s) for s in args.seeds.split(",")):
        ckpt.write(args.root / f"v{seed}", seed, args.device)
    report = {"bytes": ckpt.nbytes, "seconds": time.perf_counter() - started, "writes": ckpt.timings}
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
