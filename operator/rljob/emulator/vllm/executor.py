"""vLLM's executor for one DP engine: the sleeping tags it records (separately from what the workers'
allocator holds: V-KILL-SLEEP-ASSERT lives in the gap), its skip rules for a second sleep and for a wake
of a tag that is not asleep (V-MEM-SLEEP-TWICE, V-MEM-WAKE-NOT-ASLEEP, V-MEM-WAKE-DUP-TAG), and
collective_rpc to the workers (V-ROUTE-RPC, V-TP-REPLY). Per version (exe:310-356@0.26.0,
exe:425-488@0.34.0)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from rljob.emulator.tensor_refit import Unmodelled
from rljob.emulator.vllm.errors import WorkerError
from rljob.emulator.vllm.versions import VllmProfile
from rljob.emulator.vllm.worker import Worker

log = logging.getLogger("vllm.emulator")

SLEEP_TAGS = frozenset({"weights", "kv_cache"})
# The worker methods /collective_rpc reaches (run_method: getattr on the worker, …/v1/serial_utils.py:486-510
# @0.26.0); any other name is NotImplementedError, as on a worker without an extension class.
RPC_METHODS = frozenset(
    {
        "reload_weights",
        "init_weight_transfer_engine",
        "start_weight_update",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "shutdown_weight_transfer_engine",
        "has_incomplete_weight_update",
        "compute_weight_checksums",
        "reset_weights",
        "sleep",
        "wake_up",
    }
)
VERSION_METHODS = {
    "shutdown_weight_transfer_engine": (0, 34, 0),
    "has_incomplete_weight_update": (0, 34, 0),
    "compute_weight_checksums": (0, 34, 0),
    "reset_weights": (0, 34, 0),
}


class Executor:
    def __init__(self, profile: VllmProfile, worker: Worker, world_size: int) -> None:
        self.profile = profile
        self.worker = worker
        self.world_size = world_size
        self.sleeping_tags: set[str] = set()
        self._sleeping_flag = False  # 0.26's `is_sleeping`, cleared only by a wake that completes

    @property
    def is_sleeping(self) -> bool:
        if self.profile.executor_sleep_skips_on_any_tag:
            return self._sleeping_flag
        return bool(self.sleeping_tags)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One collective_rpc to every worker of this engine, waited for (V-TP-REPLY)."""
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Unmodelled:
            raise
        except Exception as e:
            raise WorkerError(str(e)) from e

    def sleep(self, level: int) -> None:
        any_tag = self.profile.executor_sleep_skips_on_any_tag
        if self._sleeping_flag if any_tag else "weights" in self.sleeping_tags:
            log.warning("Executor is already sleeping.")
            return
        self._call("sleep", level)  # raises before the tags are recorded (V-KILL-SLEEP-ASSERT)
        if any_tag:
            self.sleeping_tags = set(SLEEP_TAGS)
            self._sleeping_flag = True
        else:
            self.sleeping_tags |= SLEEP_TAGS

    def wake_up(self, tags: list[str] | None) -> None:
        if not self.is_sleeping:
            log.warning("Executor is not sleeping.")
            return
        for tag in tags or ():
            if tag not in self.sleeping_tags:
                log.warning("Tag %s is not in sleeping tags %s", tag, self.sleeping_tags)
                return
        self._call("wake_up", tags)
        if tags:
            for tag in tags:
                self.sleeping_tags.remove(tag)  # a repeated tag: KeyError after the wake (V-MEM-WAKE-DUP-TAG)
        else:
            self.sleeping_tags.clear()
        if not self.sleeping_tags:
            self._sleeping_flag = False

    def discard(self, tags: tuple[str, ...]) -> None:
        """0.34: discard tags with no backup (release_kv_cache_memory)."""
        to_discard = set(tags) - self.sleeping_tags
        if not to_discard:
            log.warning("Tags %s are already sleeping.", tags)
            return
        try:
            self._call("discard", tuple(to_discard))
        finally:
            self.sleeping_tags |= to_discard

    async def collective_rpc(
        self, method: str, timeout: float | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """A worker method by name; the result once per worker. An expired `timeout` leaves the workers
        running it (mpx:361-398@0.26.0)."""
        since = VERSION_METHODS.get(method)
        if method not in RPC_METHODS or (since is not None and self.profile.key < since):
            raise WorkerError(f"Method {method!r} is not implemented.")
        try:
            result = getattr(self.worker, method)(*args, **kwargs)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                result = await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise TimeoutError(f"RPC call to {method} timed out.") from None
        except Unmodelled:
            raise
        except Exception as e:
            raise WorkerError(str(e)) from e
        return [result] * self.world_size
