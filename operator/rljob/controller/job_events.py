"""A decision's events, for people (`kubectl describe`): posted in the background, in order, never on the
lifecycle's critical path."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from rljob.controller.kube import Kube
from rljob.lifecycle.model import Event

CLOSE_SECONDS = 5.0  # at close, events still being posted get this long


class EventPoster:
    def __init__(self, kube: Kube, namespace: str, body: Mapping[str, Any]) -> None:
        self.kube = kube
        self.namespace = namespace
        self.body = body  # the RLJob the events are about
        self._tasks: set[asyncio.Task[None]] = set()

    def post(self, events: Sequence[Event]) -> None:
        task = asyncio.get_running_loop().create_task(self._post(events))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, events: Sequence[Event]) -> None:
        body = dict(self.body)
        for event in events:  # in order, so `kubectl describe` reads like the timeline
            await self.kube.post_event(
                self.namespace, body, event.type.value, event.reason.value, event.message
            )

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CLOSE_SECONDS)
