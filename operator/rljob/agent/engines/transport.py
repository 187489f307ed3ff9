"""The HTTP transport every engine's client shares: one session to the engine's port, every call timed by
operation, transport failures told apart from the engine's answers (base.py's errors), and the pass-through
a framework endpoint forwards with. Each engine's client (agent/engines/<name>/client.py) adds its routes,
their bodies, its keys and how its error bodies read."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import aiohttp

from rljob.agent.engines.base import EngineError, EngineUnreachable
from rljob.agent.timing import add_external

Q = TypeVar("Q")  # the engine's version quirks
Params = Mapping[str, str] | Sequence[tuple[str, str]]


class EngineHTTP(Generic[Q]):
    """The engine's HTTP API at `base_url`; `quirks` once the engine's version was read."""

    name = "the engine"  # how messages name the engine

    def __init__(
        self, base_url: str, *, call_timeout_s: float, observe: Callable[[str, float], None]
    ) -> None:
        self.base_url = base_url
        self.call_timeout_s = call_timeout_s
        self._observe = observe  # latency histogram by operation
        self._session: aiohttp.ClientSession | None = None
        self.quirks: Q | None = None

    async def start(self) -> None:
        # No connection pool limit: long-polling routes must not starve a probe or the liveness call.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), raise_for_status=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def q(self) -> Q:
        """The quirks; a RuntimeError before the version was read."""
        if self.quirks is None:
            raise RuntimeError(f"{self.name} version not detected yet")
        return self.quirks

    def headers(self, path: str) -> Mapping[str, str]:
        """The auth headers a call to `path` carries."""
        return {}

    def calling(self, operation: str) -> contextlib.AbstractContextManager[None]:
        """Held while the call `operation` is in flight."""
        return contextlib.nullcontext()

    def message(self, body: Any, text: str) -> str:
        """What an error answer says, from its JSON body (None if none) or its text."""
        return text[:500]

    async def _call(
        self,
        operation: str,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Params | None = None,
        timeout: float | None = None,
    ) -> tuple[int, Any, str]:
        """(status, JSON body or None, text). TimeoutError: a hang; EngineUnreachable: no connection."""
        assert self._session is not None, "start() first"
        started = time.monotonic()
        try:
            with self.calling(operation):
                async with self._session.request(
                    method,
                    self.base_url + path,
                    json=body,
                    params=params,
                    headers=self.headers(path),
                    timeout=aiohttp.ClientTimeout(
                        total=timeout if timeout is not None else self.call_timeout_s
                    ),
                ) as resp:
                    text = await resp.text()
                    status = resp.status
        except TimeoutError:
            raise  # aiohttp timeouts are also ClientConnectionErrors: a hang is not death
        except (aiohttp.ClientConnectionError, ConnectionError) as e:
            raise EngineUnreachable(f"{operation}: {e.__class__.__name__}: {e}") from e
        finally:
            elapsed = time.monotonic() - started
            self._observe(operation, elapsed)
            add_external(elapsed)
        try:
            parsed: Any = json.loads(text) if text else None
        except ValueError:
            parsed = None
        return status, parsed, text

    async def _ok(self, operation: str, method: str, path: str, **kw: Any) -> Any:
        """The JSON body of a 200; EngineError for any other status."""
        status, body, text = await self._call(operation, method, path, **kw)
        if status != 200:
            raise EngineError(operation, status, self.message(body, text))
        return body

    # --- for plugins ---------------------------------------------------------------------------------

    async def get_json(self, operation: str, path: str, timeout: float = 5.0) -> Any:
        """A GET on the engine's port for a plugin of the agent (e.g. a GPU probe that reads through the
        engine); timed and authenticated like every other call, EngineUnreachable if the port is gone."""
        return await self._ok(operation, "GET", path, timeout=timeout)

    # --- for the framework endpoint ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def forward(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A framework's call passed through as it came (the routes its endpoint does not answer itself):
        the framework's headers (its key, not the agent's), no deadline (a generation streams as long as it
        takes), not timed (the framework's calls are not the agent's). The response streams; transport
        failures raise aiohttp.ClientError as aiohttp does."""
        assert self._session is not None, "start() first"
        async with self._session.request(
            method,
            self.base_url.rstrip("/") + path,
            headers=dict(headers),
            data=body,
            timeout=aiohttp.ClientTimeout(total=None),
        ) as response:
            yield response
