"""Not SGLang: the lifecycle calls this server received, counted per route and per (route, arguments), and
the repeats among the non-idempotent ones, for the chaos report and the self-healing tests
(`GET /_emulator/calls`). A call is logged when it arrives, before any fault delay or handler runs, so a
repeat sent while the first call is still running counts too.

Repeats, in the order the calls arrived (not the order SGLang processed them):
- a release of a tag released before with no resume of it in between (C-MEM-DOUBLE-RELEASE: fatal);
- a resume of a tag not released since its last resume, or never (C-MEM-RESUME-UNRELEASED: fatal);
- a refit (disk, tensor, distributed) carrying a weight_version this server was already asked to load.
Pause, continue, flush and update_weight_version are idempotent: counted, never repeats.

The vLLM emulator logs its routes the same way (its query parameters as the body where it has none):
- a `/sleep` of level 1 or more while a tag sleeps (V-KILL-SLEEP-TWICE: a silent no-op), and a
  `/release_kv_cache_memory` while the KV cache sleeps;
- a `/wake_up` naming a tag that does not sleep, or with no tag while nothing sleeps (V-KILL-WAKE-NOT-ASLEEP);
- a refit loading what this server was already asked to load: `reload_weights` of the same path through
  `/collective_rpc`, a `/finish_weight_update` carrying a weight_version seen before.
Pause, resume, flush, the weight-transfer init and start, each update push and update_weight_version are
counted, never repeats.

With RLJOB_EMULATOR_CALL_LOG=FILE in its environment the server also appends one JSON line per call (and
one at start, `boot`) to FILE, so the counts outlive the process: a chaos run reads the files of servers
that were killed or whose pods were deleted.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from typing import Any

from aiohttp import web

RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"
SLEEP, WAKE, RELEASE_KV = "/sleep", "/wake_up", "/release_kv_cache_memory"  # vLLM's
RPC, FINISH = "/collective_rpc", "/finish_weight_update"  # vLLM's disk refit (reload_weights), a push's end
SLEEP_TAGS = ("kv_cache", "weights")  # what a vLLM sleep of level 1 or more puts to sleep
REFITS = frozenset(
    {"/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed"}
)
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # an empty or missing list means every tag


CALL_LOG_ENV = "RLJOB_EMULATOR_CALL_LOG"


class CallLog:
    def __init__(self, path: str | None = None) -> None:
        self.boot_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.routes: Counter[str] = Counter()
        self.by_args: Counter[tuple[str, str]] = Counter()
        self.repeats: list[dict[str, Any]] = []
        self._released: set[str] = set()
        self._loaded: set[str] = set()
        self._path = path if path is not None else os.environ.get(CALL_LOG_ENV)
        self._write({"boot": self.boot_id, "pid": os.getpid(), "at": self.started_at})

    def _write(self, line: dict[str, Any]) -> None:
        if not self._path:
            return
        with open(self._path, "a") as f:  # one short line per call: appends do not interleave
            f.write(json.dumps(line) + "\n")

    def record(self, route: str, raw: bytes) -> None:
        self.routes[route] += 1
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        repeats = len(self.repeats)
        args = self._count(route, body)
        self._write(
            {
                "route": route,
                "args": args,
                "boot": self.boot_id,
                "repeat": self.repeats[-1]["why"] if len(self.repeats) > repeats else None,
                "at": time.time(),
            }
        )

    def _count(self, route: str, body: dict[str, Any]) -> str:
        if route in (RELEASE, RESUME):
            tags = sorted(set(body.get("tags") or ALL_TAGS))
            self.by_args[(route, ",".join(tags))] += 1
            if route == RELEASE:
                again = [t for t in tags if t in self._released]
                self._released.update(tags)
                why = "released again with no resume in between"
            else:
                again = [t for t in tags if t not in self._released]
                self._released.difference_update(tags)
                why = "resumed while not released"
            if again:
                self._repeat(route, ",".join(tags), f"{', '.join(again)} {why}")
            return ",".join(tags)
        if route in (SLEEP, WAKE, RELEASE_KV):
            return self._vllm_memory(route, body)
        if route == RPC and body.get("method") == "reload_weights":
            path = (body.get("kwargs") or {}).get("weights_path")
            args = f"reload_weights={path}"
            self.by_args[(route, args)] += 1
            if path is not None:
                if f"path:{path}" in self._loaded:
                    self._repeat(route, args, f"{path} loaded again")
                self._loaded.add(f"path:{path}")
            return args
        if route in REFITS or (route == FINISH and body.get("weight_version") is not None):
            version = body.get("weight_version")
            args = f"weight_version={version}" if version is not None else "push"
            self.by_args[(route, args)] += 1
            if version is not None:
                if version in self._loaded:
                    self._repeat(route, args, f"weight_version {version} loaded again")
                self._loaded.add(str(version))
            return args
        self.by_args[(route, "")] += 1
        return ""

    def _vllm_memory(self, route: str, query: dict[str, Any]) -> str:
        """vLLM's sleep, wake and KV release: their query parameters, each a list of values."""
        if route == SLEEP:
            raw = query.get("level") or ["1"]
            level_text = str(raw[0] if isinstance(raw, list) else raw)
            level = int(level_text) if level_text.lstrip("-").isdigit() else 0  # vLLM refuses the rest
            tags = list(SLEEP_TAGS) if level >= 1 else []
            again, why = [t for t in tags if t in self._released], "slept again with no wake in between"
            self._released.update(tags)
            args = f"level={level}"
        elif route == RELEASE_KV:
            tags = ["kv_cache"]
            again, why = [t for t in tags if t in self._released], "released again with no wake in between"
            self._released.update(tags)
            args = "kv_cache"
        else:
            given = query.get("tags") or []
            named = sorted({str(t) for t in (given if isinstance(given, list) else [given])})
            tags = named or sorted(self._released)
            again = [t for t in named if t not in self._released] or ([] if tags else ["every tag"])
            why = "woken while not asleep"
            self._released.difference_update(tags)
            args = ",".join(named)
        self.by_args[(route, args)] += 1
        if again:
            self._repeat(route, args, f"{', '.join(again)} {why}")
        return args

    def _repeat(self, route: str, args: str, why: str) -> None:
        self.repeats.append({"route": route, "args": args, "why": why, "at": time.time()})

    def report(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "bootId": self.boot_id,
            "startedAt": self.started_at,
            "routes": dict(self.routes),
            "calls": [
                {"route": route, "args": args, "count": n}
                for (route, args), n in sorted(self.by_args.items())
            ],
            "repeats": list(self.repeats),
        }


CALL_LOG_KEY = web.AppKey("call_log", CallLog)
