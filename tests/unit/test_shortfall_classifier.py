"""The agent's release verification tells a deterministic shortfall (permanent) from memory that is
still being freed (retryable): agent/operations.py FreedHistory."""

from __future__ import annotations

from rljob.agent.operations import FREED_NOISE_BYTES, FREED_STABLE_S, FreedHistory

GiB = 1 << 30
NEED = {0: 30 * GiB, 1: 30 * GiB}


def history(*samples: tuple[float, dict[int, int]]) -> FreedHistory:
    h = FreedHistory()
    for at, freed in samples:
        h.add(freed, at)
    return h


def test_freed_some_and_stable_is_final() -> None:
    """Only cuda_graph released: 2 GiB freed on each GPU from the first sample on, 30 GiB asked."""
    h = history(
        (0.0, {0: 2 * GiB, 1: 2 * GiB}), (0.5, {0: 2 * GiB, 1: 2 * GiB}), (5.0, {0: 2 * GiB, 1: 2 * GiB})
    )
    assert h.shortfall_is_final(NEED, now=5.0, window_s=5)


def test_memory_still_moving_at_the_deadline_is_not_final() -> None:
    """A delayed unmap that freed more shortly before the deadline may still reach the target."""
    h = history((0.0, {0: 2 * GiB, 1: 2 * GiB}), (4.5, {0: 10 * GiB, 1: 2 * GiB}))
    assert not h.shortfall_is_final(NEED, now=5.0, window_s=5)
    # Once it has stopped for FREED_STABLE_S, it is.
    assert h.shortfall_is_final(NEED, now=4.5 + FREED_STABLE_S, window_s=60)


def test_a_gpu_that_freed_nothing_may_not_have_unmapped_yet() -> None:
    """slime#579: rank 0 answers, another rank frees later; nothing freed yet is no evidence of a cap."""
    h = history((0.0, {0: 2 * GiB, 1: 0}), (60.0, {0: 2 * GiB, 1: 0}))
    assert not h.shortfall_is_final(NEED, now=60.0, window_s=60)
    h = history((0.0, {0: 0, 1: 0}), (1.0, {0: 0, 1: 0}))
    assert not h.shortfall_is_final(NEED, now=1.0, window_s=1)


def test_allocator_noise_is_not_movement() -> None:
    h = history((0.0, {0: 2 * GiB, 1: 2 * GiB}), (4.9, {0: 2 * GiB + FREED_NOISE_BYTES // 2, 1: 2 * GiB}))
    assert h.shortfall_is_final(NEED, now=5.0, window_s=5)


def test_a_short_window_needs_half_of_it_stable() -> None:
    """verify.timeoutSeconds may be 1: the last half second must be still."""
    h = history((0.0, {0: 2 * GiB, 1: 2 * GiB}), (0.6, {0: 3 * GiB, 1: 2 * GiB}))
    assert not h.shortfall_is_final(NEED, now=1.0, window_s=1)
    h = history((0.0, {0: 3 * GiB, 1: 2 * GiB}), (1.0, {0: 3 * GiB, 1: 2 * GiB}))
    assert h.shortfall_is_final(NEED, now=1.0, window_s=1)


def test_no_shortfall_or_no_sample_is_never_final() -> None:
    assert not FreedHistory().shortfall_is_final(NEED, now=10.0, window_s=5)
    h = history((0.0, {0: 30 * GiB, 1: 31 * GiB}))
    assert not h.shortfall_is_final(NEED, now=10.0, window_s=5)
