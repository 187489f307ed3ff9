"""A toy tokenizer and decoder: words are tokens, outputs are a deterministic function of the loaded
weights, so a test can tell valid weights from garbage and one checkpoint from another."""

from __future__ import annotations

import hashlib
import zlib

VOCAB = 50_000
GARBAGE_MARKER = "\ufffdGARBAGE\ufffd"
"""Appears in every output produced by weights whose contents were lost (resume without CPU backup)."""


def encode(text: str) -> list[int]:
    return [zlib.crc32(word.encode()) % VOCAB for word in text.split()]


def next_token(weights_id: str, prompt: list[int], position: int, sample: int) -> int:
    h = hashlib.blake2b(digest_size=4)
    h.update(weights_id.encode())
    h.update(len(prompt).to_bytes(4, "little"))
    h.update(bytes(str(prompt[-8:]), "ascii"))
    h.update(position.to_bytes(4, "little"))
    h.update(sample.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little") % VOCAB


def decode(ids: list[int], *, garbage: bool) -> str:
    words = " ".join(f"t{i}" for i in ids)
    return f"{GARBAGE_MARKER} {words}" if garbage else words
