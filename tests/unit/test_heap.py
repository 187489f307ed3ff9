"""controller/heap.py: the collector's long-lived heap frozen once; the C heap trimmed on a timer."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from rljob.controller import heap


def test_freeze_moves_the_heap_out_of_the_collector_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_frozen", False)
    try:
        heap.freeze()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        heap.freeze()  # a second call does not freeze what came since
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_the_trim_thread_trims_again_and_again() -> None:
    calls: list[int] = []
    done = threading.Event()

    def trim(pad: int) -> int:
        calls.append(pad)
        if len(calls) >= 3:
            done.set()
        return 1

    thread = heap.trim_every(0.01, trim)
    assert thread is not None and thread.daemon
    assert done.wait(5), calls
    assert set(calls) == {0}  # malloc_trim(0): keep no padding at the top of the heap


def test_glibc_malloc_trim_is_found_and_returns() -> None:
    trim = heap.malloc_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    before = time.monotonic()
    assert trim(0) in (0, 1)  # 1: memory was given back, 0: there was none to give
    assert time.monotonic() - before < 1
