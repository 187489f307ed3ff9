"""The model a GPU-tier process serves or trains, named by one spec in `RLJOB_GPU_MODEL`: `tiny` (the
default: rljob.testing.tiny_model's TinyLlama, 2 layers, built in under a second), `8b`
(rljob.testing.llama_checkpoint's Llama-3-8B shapes under $RLJOB_LLAMA_CHECKPOINT_ROOT, whose base/ is
written once), or `package.module:factory`, called without arguments. Every such model has
`write(directory, seed) -> Path` (a checkpoint directory SGLang loads); version `seed`'s weights are the same
bytes in every process (`model_weights`)."""

from __future__ import annotations

import importlib
import os
from typing import Any

MODEL_ENV = "RLJOB_GPU_MODEL"
MODEL_VARS = ("RLJOB_LLAMA_CHECKPOINT_ROOT",)  # what the models read from the environment


def spec_from_env() -> str:
    return os.environ.get(MODEL_ENV) or "tiny"


def load_model(spec: str) -> Any:
    if spec == "tiny":
        from rljob.testing.tiny_model import TinyLlama

        return TinyLlama()
    if spec == "8b":
        from rljob.testing.llama_checkpoint import llama3_8b

        return llama3_8b()
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"{MODEL_ENV} takes 'tiny', '8b' or 'package.module:factory', not {spec!r}")
    return getattr(importlib.import_module(module), attr)()


def model_weights(model: Any, seed: int, device: str = "cuda") -> dict[str, Any]:
    """Version `seed`'s weights as bf16 tensors on `device`, in the order of the model's parameters."""
    own = getattr(model, "cuda_weights", None)
    if own is not None and device == "cuda":
        weights = dict(own(seed))
        import torch

        torch.cuda.synchronize()
        return weights
    import numpy as np
    import torch

    return {
        name: torch.from_numpy(bits.view(np.int16).reshape(shape).copy()).view(torch.bfloat16).to(device)
        for name, (shape, bits) in model.weights(seed).items()
    }
