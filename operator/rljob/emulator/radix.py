"""Prefix cache over token ids (SGLang's radix tree, as a plain trie): the cached-token counts and the
cache hit rate the emulator reports are real matches, not made-up numbers."""

from __future__ import annotations


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._root: dict[int, dict] = {}  # type: ignore[type-arg]
        self.tokens = 0

    def match(self, ids: list[int]) -> int:
        """Length of the longest cached prefix of `ids`."""
        node, n = self._root, 0
        for tok in ids:
            nxt = node.get(tok)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    def insert(self, ids: list[int]) -> None:
        if len(ids) > self.capacity:
            return
        if self.tokens + len(ids) > self.capacity:
            self.reset()  # crude eviction: enough for hit-rate accounting
        node = self._root
        for tok in ids:
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                self.tokens += 1
            node = nxt

    def reset(self) -> None:
        self._root, self.tokens = {}, 0
