"""Reads a flattened-bucket push the way SGLang will, without running it: every global the pickle names
is a stand-in, so nothing in it executes. SGLang's scheduler reads six attributes of each metadata entry
outside any try (C-REFIT-TENSOR-META): one missing kills the server, so the agent refuses the push; so are
bytes that are not a pickle at all (C-REFIT-TENSOR-PICKLE)."""

from __future__ import annotations

import functools
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


@functools.cache  # one class per global: a bucket names the same few globals once per tensor
def _stand_in_class(module: str, name: str) -> type[_StandIn]:
    return type(f"{module}.{name}", (_StandIn,), {})


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _stand_in_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return _StandIn()


def read(payload: bytes) -> tuple[Any, str | None]:
    """One decoded entry read as SGLang's unpickler reads it: (the object with stand-ins, None), or (None,
    why SGLang cannot read it: C-REFIT-TENSOR-PICKLE, fatal on every version)."""
    try:
        return _Reader(io.BytesIO(payload)).load(), None
    except Exception as e:  # any failure here is one SGLang's scheduler would raise
        return None, f"{type(e).__name__}: {e}"[:200] or type(e).__name__


def unreadable(payload: bytes) -> str | None:
    """Why SGLang's unpickler cannot read one decoded entry (C-REFIT-TENSOR-PICKLE: fatal on every
    version), else None."""
    return read(payload)[1]


def missing_metadata(payload: bytes) -> str | None:
    """For one decoded entry of a flattened-bucket push: the path of the first metadata field SGLang would
    miss (e.g. "metadata[2].numel"), else None. A payload that is not a readable pickle is left to SGLang:
    None."""
    return missing_in(read(payload)[0])


def missing_in(obj: Any) -> str | None:
    """`missing_metadata` of an entry already `read`."""
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
