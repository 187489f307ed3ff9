"""Times the garbage collections of a process that has this directory on its PYTHONPATH (the benchmark's
--gc-stats puts it on the operator's): gc.callbacks around every collection, per generation the count,
the seconds spent, the objects collected and the longest pause, written as JSON to $RLJOB_GC_STATS twice
a second by a daemon thread (the benchmark reads it at both ends of a window)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from typing import Any

_path = os.environ.get("RLJOB_GC_STATS")
_stats: dict[str, dict[str, float]] = {}
_began = 0.0


def _callback(phase: str, info: dict[str, Any]) -> None:
    global _began
    if phase == "start":
        _began = time.perf_counter()
        return
    pause = time.perf_counter() - _began
    gen = _stats.setdefault(f"gen{info['generation']}", {"n": 0, "seconds": 0.0, "collected": 0, "max": 0.0})
    gen["n"] += 1
    gen["seconds"] += pause
    gen["collected"] += info.get("collected", 0)
    gen["max"] = max(gen["max"], pause)


def _writer(path: str) -> None:
    while True:
        time.sleep(0.5)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(_stats, f)
        os.replace(tmp, path)


if _path:
    gc.callbacks.append(_callback)
    threading.Thread(target=_writer, args=(_path,), daemon=True, name="gc-stats").start()
