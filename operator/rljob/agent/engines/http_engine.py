"""What every engine behind an HTTP client does alike (base.py Engine): it holds its client and the facts
`discover` read, starts and closes the client, names the record's calls its way, and passes a plugin's GET
through. Each engine (agent/engines/<name>/engine.py) subclasses it with its verbs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

from rljob.agent.engines.base import EngineFacts
from rljob.agent.engines.transport import EngineHTTP

C = TypeVar("C", bound=EngineHTTP[Any])
F = TypeVar("F", bound=EngineFacts)


class HTTPEngine(Generic[C, F]):
    # The non-idempotent calls of the agent's record (agent/record.py Intent.call), as the engine names them.
    call_names: ClassVar[Mapping[str, str]] = {}

    def __init__(self, client: C) -> None:
        self.client = client
        self._facts: F | None = None

    @property
    def facts(self) -> F | None:
        return self._facts

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()

    def call_name(self, call: str) -> str:
        return self.call_names.get(call, call)

    async def get_json(self, operation: str, path: str, timeout: float = 5.0) -> Any:
        return await self.client.get_json(operation, path, timeout=timeout)
