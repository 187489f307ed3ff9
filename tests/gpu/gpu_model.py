"""The model the real-SGLang tier serves: `RLJOB_GPU_MODEL` unset or `tiny` is rljob.testing.tiny_model's
TinyLlama (2 layers, hidden 256: built in under a second); `package.module:factory` names any other
(a larger checkpoint of rljob.testing), called without arguments. Either has `write(directory, seed) ->
Path`, a checkpoint directory SGLang loads."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Protocol

MODEL_ENV = "RLJOB_GPU_MODEL"


class Model(Protocol):
    def write(self, directory: Path, seed: int) -> Path: ...


def model_from_env() -> Model:
    name = os.environ.get(MODEL_ENV, "tiny")
    if name == "tiny":
        from rljob.testing.tiny_model import TinyLlama

        return TinyLlama()
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"{MODEL_ENV} takes 'tiny' or 'package.module:factory', not {name!r}")
    model: Model = getattr(importlib.import_module(module), attr)()
    return model
