"""The operator's client for the in-pod agents: watch their state streams, send epoch-stamped commands."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import ValidationError

from rljob.api.agent import COMMAND_ADAPTER, AgentState, Command, Refusal
from rljob.controller.metrics import AGENT_COMMANDS, AGENT_REPORTS

log = logging.getLogger(__name__)
LONG_POLL_SECONDS = 10.0
MAX_STATE_BYTES = 4 * 2**20  # a streamed state line longer than this is a broken agent


@dataclass(frozen=True)
class AgentEndpoint:
    pod: str
    uid: str
    ip: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


@dataclass(frozen=True)
class CommandOutcome:
    pod: str
    accepted: bool
    refusal: str | None = None  # the agent's reason, for a 409


class AgentClient:
    def __init__(self, token: str | None = None, session: aiohttp.ClientSession | None = None) -> None:
        self.token = token  # the job's agent token: set once its Secret exists
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> AgentClient:
        if self._session is None:
            # No connection limit: every agent holds one long-poll open and takes a command beside it;
            # aiohttp's default of 100 connections would queue both at more than 50 pods.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=3),
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use AgentClient as an async context manager"
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def watch(
        self, agent: AgentEndpoint, since: int = -1, wait: float = LONG_POLL_SECONDS, boot: str | None = None
    ) -> AsyncIterator[AgentState]:
        """Every state the operator acts on newer than `since`, as the agent streams them (`watch=true`, a
        JSON a line), until `wait` passed: one request for all the reports of that time. An agent that
        does not stream answers one state, as a long-poll: the stream then ends after it."""
        params = {"since": str(since), "wait": str(wait), "changes": "operator", "watch": "true"}
        if boot is not None:
            params["boot"] = boot
        timeout = aiohttp.ClientTimeout(total=wait + 5, connect=3)
        async with self.session.get(
            f"{agent.url}/v1/state", params=params, headers=self._headers(), timeout=timeout
        ) as resp:
            resp.raise_for_status()
            while line := await resp.content.readline(max_line_length=MAX_STATE_BYTES):
                if line.strip():
                    yield AgentState.model_validate_json(line)

    async def send(self, agent: AgentEndpoint, command: Command) -> CommandOutcome:
        body = COMMAND_ADAPTER.dump_python(command, mode="json", by_alias=True, exclude_none=True)
        action = command.action.value
        try:
            async with self.session.post(
                f"{agent.url}/v1/commands",
                json=body,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=15, connect=3),
            ) as resp:
                if resp.status in (200, 202):
                    AGENT_COMMANDS.labels(action=action, outcome="accepted").inc()
                    return CommandOutcome(agent.pod, True)
                text = await resp.text()
                with contextlib.suppress(ValidationError, ValueError):
                    text = Refusal.model_validate_json(text).reason
                AGENT_COMMANDS.labels(action=action, outcome=f"http_{resp.status}").inc()
                return CommandOutcome(agent.pod, False, f"HTTP {resp.status}: {text[:500]}")
        except (TimeoutError, aiohttp.ClientError) as err:
            AGENT_COMMANDS.labels(action=action, outcome="unreachable").inc()
            return CommandOutcome(agent.pod, False, f"unreachable: {err!r}"[:500])


class AgentWatch:
    """Watches one agent's state stream and keeps its latest state; calls `wake` on every change. One
    per pod."""

    def __init__(self, client: AgentClient, endpoint: AgentEndpoint, wake: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.latest: AgentState | None = None
        self.client = client
        self._wake = wake
        self._task = asyncio.create_task(self._run(), name=f"agent-watch-{endpoint.pod}")

    async def _run(self) -> None:
        since = -1
        boot: str | None = None
        failures = 0
        while True:
            try:
                async for state in self.client.watch(self.endpoint, since, LONG_POLL_SECONDS, boot):
                    failures = 0
                    if state.boot_id != boot:  # a restarted agent starts its revisions again
                        boot, since = state.boot_id, -1
                    if since < 0 or state.revision > since:
                        # Reports only move forward: an older revision from the same boot is dropped.
                        self.latest = state
                        since = state.revision
                        AGENT_REPORTS.inc()
                        self._wake()
            except (TimeoutError, aiohttp.ClientError, HttpProcessingError, ValidationError) as err:
                failures += 1
                log.debug("agent %s: %r", self.endpoint.pod, err)
                await asyncio.sleep(min(2.0, 0.1 * failures))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
