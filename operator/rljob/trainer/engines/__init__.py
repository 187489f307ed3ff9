"""The trainer SDK's side of each engine, one folder each (trainer/engines/<name>/): how a trainer's tensors
are packed into the payloads the engine reads, and how their digest is hashed the way the engine's weights
checksum will hash them. The SDK's registry: the only SDK module that names the engines (the SDK never
imports the agent, whose registry is the agent's).

One engine packs and hashes today (ENGINE): `packing` and `digest` are its modules."""

from __future__ import annotations

from rljob.api.spec import DEFAULT_ENGINE
from rljob.trainer.engines.sglang import digest, packing

ENGINE = DEFAULT_ENGINE  # the engine whose payloads the SDK packs and whose checksum it reproduces

__all__ = ["ENGINE", "digest", "packing"]
