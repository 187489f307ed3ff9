"""A toy tokenizer and language model: words are tokens; each context (the loaded weights and the tokens
before a position) has a next-token distribution, so outputs and their logprobs are a deterministic
function of the weights, the prompt and the sampling seed, and a test can tell valid weights from
garbage and one checkpoint from another.

The distribution of a context: `CANDIDATES` tokens with logits spread over [0, SPREAD), every other
token of the vocabulary at TAIL_LOGIT. Logprobs are exact log-softmax values of it (rows C-GEN-LOGPROB-*
of docs/sglang-conformance.md)."""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

VOCAB = 50_000
EOS_TOKEN_ID = 2
CANDIDATES = 32
SPREAD = 10.0
TAIL_LOGIT = -4.0
CONTEXT_WINDOW = 8  # the tokens of a context that shape its distribution, with its length
GARBAGE_MARKER = "\ufffdGARBAGE\ufffd"
"""Appears in every output produced by weights whose contents were lost (resume without CPU backup)."""


def encode(text: str) -> list[int]:
    return [zlib.crc32(word.encode()) % VOCAB for word in text.split()]


def token_text(token: int) -> str:
    return f"t{token}"


def decode(ids: Sequence[int], *, garbage: bool) -> str:
    words = " ".join(token_text(i) for i in ids)
    return f"{GARBAGE_MARKER} {words}" if garbage else words


def _stream(*parts: bytes) -> Any:
    h = hashlib.blake2b(digest_size=64)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h


def _uniforms(key: bytes, n: int) -> list[float]:
    """n deterministic uniforms in [0, 1) from a key."""
    out: list[float] = []
    block = 0
    while len(out) < n:
        digest = _stream(key, block.to_bytes(4, "little")).digest()
        out += [int.from_bytes(digest[i : i + 8], "little") / 2**64 for i in range(0, 64, 8)]
        block += 1
    return out[:n]


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


@dataclass(frozen=True)
class Distribution:
    """One context's next-token distribution. `ids` and `logits` are the candidates, logits descending;
    the VOCAB - CANDIDATES other tokens all have TAIL_LOGIT."""

    ids: tuple[int, ...]
    logits: tuple[float, ...]

    def log_z(self, temperature: float) -> float:
        """log of the softmax denominator of logits / temperature."""
        tail = math.log(VOCAB - len(self.ids)) + TAIL_LOGIT / temperature
        return _logsumexp([*(x / temperature for x in self.logits), tail])

    def logprob(self, token: int, temperature: float = 1.0) -> float:
        try:
            logit = self.logits[self.ids.index(token)]
        except ValueError:
            logit = TAIL_LOGIT
        return logit / temperature - self.log_z(temperature)

    def top(self, k: int, temperature: float = 1.0) -> list[tuple[float, int]]:
        """The k most likely tokens as (logprob, id), most likely first; ties (the tail) by ascending id."""
        z = self.log_z(temperature)
        out = [(x / temperature - z, t) for x, t in zip(self.logits, self.ids, strict=True)][:k]
        tail_lp = TAIL_LOGIT / temperature - z
        return out + [(tail_lp, t) for t in self._tail_ids(k - len(out))]

    def _tail_ids(self, n: int) -> list[int]:
        taken = set(self.ids)
        out: list[int] = []
        t = 0
        while len(out) < n and t < VOCAB:
            if t not in taken:
                out.append(t)
            t += 1
        return out

    def _tail_id(self, index: int) -> int:
        """The index-th token (ascending) that is not a candidate."""
        taken = sorted(self.ids)
        t = index
        for c in taken:  # each candidate at or below t pushes t up by one
            if c <= t:
                t += 1
        return t

    def sample(self, u: float, params: SamplingParams) -> int:
        """Inverse-CDF draw with uniform u over the top-k / min-p / top-p filtered distribution at the
        request's temperature (greedy: the argmax). Tail tokens rank below every candidate, ascending id."""
        if params.greedy:
            return self.ids[0]
        t = params.temperature
        z = self.log_z(t)
        probs = [math.exp(x / t - z) for x in self.logits]
        tail_each = math.exp(TAIL_LOGIT / t - z)
        n_cand, n_tail = len(probs), VOCAB - len(probs)
        if params.top_k > 0:
            n_cand, n_tail = min(n_cand, params.top_k), min(n_tail, max(0, params.top_k - n_cand))
        if params.min_p > 0:
            floor = params.min_p * probs[0]
            n_cand = min(n_cand, sum(1 for p in probs if p >= floor))
            n_tail = n_tail if tail_each >= floor and n_cand == len(probs) else 0
        cumulative = _accumulate(probs[:n_cand])
        if params.top_p < 1.0:
            if cumulative[-1] >= params.top_p:
                n_cand, n_tail = bisect.bisect_left(cumulative, params.top_p) + 1, 0
                cumulative = cumulative[:n_cand]
            elif n_tail:
                n_tail = min(n_tail, math.ceil((params.top_p - cumulative[-1]) / tail_each))
        x = u * (cumulative[-1] + n_tail * tail_each)
        i = bisect.bisect_right(cumulative, x)
        if i < n_cand or n_tail == 0:
            return self.ids[min(i, n_cand - 1)]
        return self._tail_id(min(n_tail - 1, int((x - cumulative[-1]) / tail_each)))


def _accumulate(xs: Sequence[float]) -> list[float]:
    out, s = [], 0.0
    for x in xs:
        s += x
        out.append(s)
    return out


@functools.lru_cache(maxsize=65536)
def _distribution(weights_id: str, length: int, window: tuple[int, ...]) -> Distribution:
    key = _stream(weights_id.encode(), length.to_bytes(4, "little"), str(window).encode()).digest()
    u = _uniforms(key, 4 * CANDIDATES)
    ids: list[int] = []
    for x in u[CANDIDATES:]:
        t = int(x * VOCAB)
        if t not in ids:
            ids.append(t)
        if len(ids) == CANDIDATES:
            break
    ranked = sorted(zip((SPREAD * x for x in u[: len(ids)]), ids, strict=True), reverse=True)
    return Distribution(tuple(t for _, t in ranked), tuple(x for x, _ in ranked))


def distribution(weights_id: str, context: Sequence[int]) -> Distribution:
    """The next-token distribution after `context` (prompt + output so far) under the given weights."""
    return _distribution(weights_id, len(context), tuple(context[-CONTEXT_WINDOW:]))


@dataclass(frozen=True)
class SamplingParams:
    """The sampling_params fields that change which tokens come out (…/sampling/sampling_params.py):
    temperature 0 means greedy (top_k 1 at temperature 1)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """The temperature the returned output logprobs are taken at: 1 when greedy (C-GEN-LOGPROB-VALUES)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Sampler:
    """What the scheduler calls per emitted token: the draw for one sample of one request."""

    params: SamplingParams = field(default_factory=SamplingParams)
    sample: int = 0  # the sample's index in its request: parallel samples differ
    order: tuple[str, ...] = ("str", "token", "length")  # the version's check_finished order

    def next_token(self, weights_id: str, context: Sequence[int]) -> int:
        key = _stream(
            self.params.seed.to_bytes(8, "little", signed=True),
            self.sample.to_bytes(4, "little"),
            weights_id.encode(),
            len(context).to_bytes(4, "little"),
            str(tuple(context[-CONTEXT_WINDOW:])).encode(),
        ).digest()
        u = int.from_bytes(key[:8], "little") / 2**64
        return distribution(weights_id, context).sample(u, self.params)

    def stop_reason(self, output: Sequence[int], max_new_tokens: int) -> dict[str, Any] | None:
        """The finish reason when `output` ends the request by a stop, else None (the scheduler then ends
        it at max_new_tokens). Checked in `order`; ignore_eos also turns off stop_token_ids
        (C-GEN-FINISH)."""
        if not output:
            return None
        for check in self.order:
            if check == "length" and len(output) >= max_new_tokens:
                return None
            if check == "token" and not self.params.ignore_eos:
                last = output[-1]
                if last in self.params.stop_token_ids or last == EOS_TOKEN_ID:
                    return {"type": "stop", "matched": last}
            if check == "str" and self.params.stop:
                longest = max(len(s) for s in self.params.stop)
                tail = decode(output[-(longest + 1) :], garbage=False)
                for s in self.params.stop:
                    if s in tail:
                        return {"type": "stop", "matched": s}
        return None
