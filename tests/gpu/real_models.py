"""The models the real-SGLang tier serves, as a process on the GPU makes them: `tiny`
(rljob.testing.tiny_model, 2 layers, for the protocol tests) and `8b` (rljob.testing.llama_checkpoint's
Llama-3-8B shapes under a root whose base/ is already written, for the figures). Version `seed`'s
weights on the GPU and its checkpoint directory are the same bytes in every process (real_trainer.py,
direct_push.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.testing.llama_checkpoint import ShardedLlama
from rljob.testing.tiny_model import TinyLlama

MODELS = ("tiny", "8b")


@dataclass(frozen=True)
class Built8B:
    """A run's Llama-3-8B-shaped checkpoints (conftest's `llama8b`): `launch` is version 0; `ckpt.write`
    makes another in seconds (its layer shards hard-linked from `ckpt.base`); `build` is where the build's
    seconds went."""

    ckpt: ShardedLlama
    launch: Path
    build: dict[str, Any]


def load(name: str, root: str | Path | None = None) -> TinyLlama | ShardedLlama:
    if name == "tiny":
        return TinyLlama()
    if name == "8b":
        if root is None:
            raise ValueError("the 8b model needs its root (the directory holding base/)")
        return ShardedLlama(Path(root))
    raise ValueError(f"model {name!r}: one of {MODELS}")


def cuda_weights(model: TinyLlama | ShardedLlama, seed: int) -> dict[str, Any]:
    """Version `seed`'s weights on the GPU, in the order of the model's parameters."""
    import numpy as np
    import torch

    if isinstance(model, ShardedLlama):
        weights = model.cuda_weights(seed)
        torch.cuda.synchronize()
        return weights
    return {
        name: torch.from_numpy(bits.view(np.int16).reshape(shape).copy()).view(torch.bfloat16).cuda()
        for name, (shape, bits) in model.weights(seed).items()
    }


def write(model: TinyLlama | ShardedLlama, directory: Path, seed: int) -> Path:
    """Version `seed` as a checkpoint directory SGLang loads."""
    return model.write(directory, seed)
