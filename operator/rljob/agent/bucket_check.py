"""Reads a flattened-bucket push the way SGLang will, without running it: every global the pickle names
is a stand-in, so nothing in it executes. SGLang's scheduler reads six attributes of each metadata entry
outside any try (C-REFIT-TENSOR-META): one missing kills the server, so the agent refuses the push; so are
bytes that are not a pickle at all (C-REFIT-TENSOR-PICKLE)."""

from __future__ import annotations

import io
import pickle
from typing import Any

# What `_update_weights_from_flattened_bucket` reads of each FlattenedTensorMetadata.
METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


class _StandIn:
    """Any object the pickle builds: it keeps the attributes BUILD gives it and nothing else."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return type(f"{module}.{name}", (_StandIn,), {})

    def persistent_load(self, pid: Any) -> Any:
        return _StandIn()


def unreadable(payload: bytes) -> str | None:
    """Why SGLang's unpickler cannot read one decoded entry (C-REFIT-TENSOR-PICKLE: fatal on every
    version), else None."""
    try:
        _Reader(io.BytesIO(payload)).load()
    except Exception as e:  # any failure here is one SGLang's scheduler would raise
        return f"{type(e).__name__}: {e}"[:200] or type(e).__name__
    return None


def missing_metadata(payload: bytes) -> str | None:
    """For one decoded entry of a flattened-bucket push: the path of the first metadata field SGLang would
    miss (e.g. "metadata[2].numel"), else None. A payload that is not a readable pickle is left to SGLang:
    None."""
    try:
        obj = _Reader(io.BytesIO(payload)).load()
    except Exception:  # not a pickle this reader can follow: nothing to say about its metadata
        return None
    if not isinstance(obj, dict):
        return None
    metadata = obj.get("metadata")
    if not isinstance(metadata, list | tuple):
        return None
    for j, meta in enumerate(metadata):
        attrs = getattr(meta, "__dict__", {}) if isinstance(meta, _StandIn) else {}
        for field in METADATA_FIELDS:
            if field not in attrs:
                return f"metadata[{j}].{field}"
    return None
