"""The GPU checksum the emulator serves after a tensor refit (`tensor_refit.device_checksum`) notices two
buckets swapped 8 GiB apart: 2**31 words, the period of the weights before they counted the high bits of a
word's position. The same swap under that earlier weighting (computed here on the same bytes) is invisible,
so this test fails on the earlier checksum."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.emulator import tensor_refit

pytestmark = pytest.mark.gpu

BUCKET = 4 << 20  # bytes
FAR = 8 << 30  # bytes: 2**31 words


def _low_bits_only(stream: Any) -> int:
    """The earlier definition: m_k from the low 31 bits of k alone."""
    import torch

    words = stream.view(torch.int32)
    acc = 0
    step = tensor_refit.CHECKSUM_SLICE_WORDS
    for s in range(0, words.numel(), step):
        w = words[s : s + step].to(torch.int64) & 0xFFFFFFFF
        k = torch.arange(s, s + w.numel(), dtype=torch.int64, device=stream.device)
        m = (((k & 0x7FFFFFFF) * tensor_refit.CHECKSUM_MULT + tensor_refit.CHECKSUM_ADD) & 0x7FFFFFFF) | 1
        acc += int((w * m).sum().item())
    return acc & 0xFFFFFFFFFFFFFFFF


def test_buckets_8_gib_apart_swapped_are_noticed() -> None:
    import torch

    g = torch.Generator(device="cuda").manual_seed(3)
    stream = torch.zeros(FAR + BUCKET, dtype=torch.uint8, device="cuda")
    a = torch.randint(0, 256, (BUCKET,), dtype=torch.uint8, device="cuda", generator=g)
    b = torch.randint(0, 256, (BUCKET,), dtype=torch.uint8, device="cuda", generator=g)
    stream[:BUCKET], stream[FAR:] = a, b
    before, before_low = tensor_refit.device_checksum([stream]), _low_bits_only(stream)
    stream[:BUCKET], stream[FAR:] = b, a
    after, after_low = tensor_refit.device_checksum([stream]), _low_bits_only(stream)
    assert before_low == after_low, "the earlier weighting was expected to miss this swap"
    assert before != after
    print(f"\n8 GiB apart: {before} -> {after}; low-bits-only weighting {before_low:016x} both times")
