"""The operator process's heap: kept out of the event loop's way, and given back when it is free.

- `freeze()`: once, after the first round, the long-lived heap (kopf, the clients, the models) is built,
  so that full collections, which stall the event loop and free nothing of it, no longer rescan it.
- `trim_every(seconds)`: glibc keeps the memory of freed objects (parsed watch events, HTTP bodies) in
  its heap, in pieces between objects that live on, so the RSS climbs to the high-water mark of every
  burst and stays there; `malloc_trim(0)` every TRIM_SECONDS hands the free pages back (measured in
  docs/benchmarks.md at commit 6702d4b).
  Not glibc: nothing to do."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
TRIM_SECONDS = 15.0
_frozen = False


def freeze() -> None:
    """gc.freeze() once per process, after a full collection."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim  # CDLL calls release the GIL: the loop runs meanwhile
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_every(
    seconds: float = TRIM_SECONDS, trim: Callable[[int], int] | None = None
) -> threading.Thread | None:
    """A daemon thread that trims the heap every `seconds` (with `trim`, default glibc's); None where
    there is no malloc_trim."""
    trim = trim or malloc_trim()
    if trim is None:
        log.info("no malloc_trim in this C library: the heap is not trimmed")
        return None

    def run() -> None:
        while True:
            time.sleep(seconds)
            trim(0)

    thread = threading.Thread(target=run, name="heap-trim", daemon=True)
    thread.start()
    return thread
