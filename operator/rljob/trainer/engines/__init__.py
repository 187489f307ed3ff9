"""The trainer SDK's side of each engine, one folder each (trainer/engines/<name>/): how a trainer's tensors
are packed into the payloads the engine reads, and how their digest is hashed the way the engine's weights
checksum will hash them. The SDK's registry: the only SDK module that names the engines (the SDK never
imports the agent, whose registry is the agent's).

The default engine (ENGINE) takes serialized buckets, one payload per TP rank: `packing` and `digest` are its
modules. An engine that takes one update object per bucket (its IPC handles inside) has an UpdateCodec; the
refit window names the engine the pushes go to (RefitWindow.engine), and the SDK packs for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rljob.api.spec import DEFAULT_ENGINE, EngineKind
from rljob.trainer.engines.digests import Digest
from rljob.trainer.engines.sglang import digest, packing
from rljob.trainer.engines.vllm import digest as vllm_digest
from rljob.trainer.engines.vllm import packing as vllm_packing

ENGINE = DEFAULT_ENGINE  # the engine whose payloads the SDK packs when the window names none


@dataclass(frozen=True)
class UpdateCodec:
    """An engine whose pushes are update objects: how to pack named tensors into them and digest them."""

    buckets: Callable[[Iterable[tuple[str, Any]], int], Iterator[Any]]  # each: .info, .buffer, .nbytes
    digest_named_tensors: Callable[[Iterable[tuple[str, Any]], Any], Digest]
    layout_from_config: Callable[[Any], Any]
    layout: Callable[[str | None, bool], Any]  # (architecture, tied embeddings)
    default_bucket_bytes: int


UPDATE_CODECS: Mapping[EngineKind, UpdateCodec] = {
    EngineKind.VLLM: UpdateCodec(
        buckets=vllm_packing.buckets,
        digest_named_tensors=vllm_digest.digest_named_tensors,
        layout_from_config=vllm_digest.ModelLayout.from_config,
        layout=lambda arch, tied: vllm_digest.ModelLayout(arch, tied),
        default_bucket_bytes=vllm_packing.DEFAULT_BUCKET_BYTES,
    ),
}


def update_codec(engine: str | None) -> UpdateCodec | None:
    """The codec of the engine a refit window names, where it takes update objects; None otherwise."""
    try:
        return UPDATE_CODECS.get(EngineKind(engine)) if engine is not None else None
    except ValueError:
        return None


__all__ = ["ENGINE", "UPDATE_CODECS", "UpdateCodec", "digest", "packing", "update_codec"]
