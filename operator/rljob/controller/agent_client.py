"""The operator's client for the in-pod agents: follow each agent's channel, send epoch-stamped commands."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import ValidationError

from rljob.api.agent import COMMAND_ADAPTER, AgentState, ChannelFrame, Command, CommandReply, Refusal
from rljob.controller.metrics import AGENT_COMMANDS, AGENT_REPORTS

log = logging.getLogger(__name__)
MAX_STATE_BYTES = 4 * 2**20  # a channel frame longer than this is a broken agent
COMMAND_SECONDS = 15.0  # an agent that takes longer to answer a command is unreachable
# With no frame for this long the channel pings the agent, and a pong missing for half of it again closes
# the channel: a pod that vanished without a reset (its node went) is noticed.
CHANNEL_HEARTBEAT_SECONDS = 10.0


def command_frame(command: Command) -> str:
    """A command as the channel's frame; the conductor writes one per distinct command, not one per pod."""
    return COMMAND_ADAPTER.dump_json(command, by_alias=True, exclude_none=True).decode()


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
    error: str | None = None  # the refusal's typed name (Refusal.error)
    permanent: bool = False  # Refusal.permanent: no retry and no new gang can change it


class AgentClient:
    def __init__(self, token: str | None = None, session: aiohttp.ClientSession | None = None) -> None:
        self.token = token  # the job's agent token: set once its Secret exists
        self._session = session
        self._own_session = session is None

    def open(self) -> None:
        """Make the session (once), in the running event loop."""
        if self._session is None:
            # No connection limit: every agent holds its channel open and may take a POSTed command beside
            # it; a pool limit would queue both.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=3),
            )

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AgentClient:
        self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "open() first, or use AgentClient as an async context manager"
        return self._session

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @contextlib.asynccontextmanager
    async def channel(
        self, agent: AgentEndpoint, since: int = -1, boot: str | None = None
    ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        """`GET /v1/channel`, a WebSocket: the states the operator acts on newer than `since` of `boot`,
        and commands with their answers (api/agent.py ChannelFrame)."""
        params = {"since": str(since)}
        if boot is not None:
            params["boot"] = boot
        connect = self.session.ws_connect(
            f"{agent.url}/v1/channel",
            params=params,
            headers=self._headers(),
            heartbeat=CHANNEL_HEARTBEAT_SECONDS,
            max_msg_size=MAX_STATE_BYTES,
            timeout=aiohttp.ClientWSTimeout(ws_close=3),
        )
        # The session bounds the connect only: an agent that takes the connection and never answers the
        # upgrade would hold the handshake forever.
        ws = await asyncio.wait_for(connect, CHANNEL_HEARTBEAT_SECONDS)
        async with ws:
            yield ws

    async def send(self, agent: AgentEndpoint, command: Command) -> CommandOutcome:
        """`POST /v1/commands`: for an agent whose channel is not open."""
        body = COMMAND_ADAPTER.dump_python(command, mode="json", by_alias=True, exclude_none=True)
        action = command.action.value
        try:
            async with self.session.post(
                f"{agent.url}/v1/commands",
                json=body,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=COMMAND_SECONDS, connect=3),
            ) as resp:
                if resp.status in (200, 202):
                    return _outcome(agent.pod, action, resp.status)
                text = await resp.text()
                try:
                    refusal: Refusal | str = Refusal.model_validate_json(text)
                except (ValidationError, ValueError):
                    refusal = text
                return _outcome(agent.pod, action, resp.status, refusal)
        except (TimeoutError, aiohttp.ClientError) as err:
            return _unreachable(agent.pod, action, repr(err))


def _outcome(pod: str, action: str, status: int, refusal: Refusal | str | None = None) -> CommandOutcome:
    if status in (200, 202):
        AGENT_COMMANDS.labels(action=action, outcome="accepted").inc()
        return CommandOutcome(pod, True)
    AGENT_COMMANDS.labels(action=action, outcome=f"http_{status}").inc()
    if isinstance(refusal, Refusal):
        why = f"HTTP {status}: {refusal.reason[:500]}"
        return CommandOutcome(pod, False, why, refusal.error, refusal.permanent)
    return CommandOutcome(pod, False, f"HTTP {status}: {(refusal or '')[:500]}")


def _unreachable(pod: str, action: str, why: str) -> CommandOutcome:
    AGENT_COMMANDS.labels(action=action, outcome="unreachable").inc()
    return CommandOutcome(pod, False, f"unreachable: {why}"[:500])


class AgentWatch:
    """Keeps one agent's latest state and calls `wake` on every change; sends it commands. One per pod.
    Both go over the agent's channel (`GET /v1/channel`, a WebSocket), the agent's one report transport;
    while the channel is not open (it is connecting, or the agent closed it) a command is POSTed."""

    def __init__(self, client: AgentClient, endpoint: AgentEndpoint, wake: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.latest: AgentState | None = None
        self.client = client
        self._wake = wake
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._answers: dict[tuple[str, int], asyncio.Future[CommandOutcome]] = {}  # by (action, epoch)
        self._since = -1
        self._boot: str | None = None
        self._task = asyncio.create_task(self._run(), name=f"agent-watch-{endpoint.pod}")

    async def send(self, command: Command, frame: str | None = None) -> CommandOutcome:
        """On the channel: a frame (`frame`, the command's `command_frame` when the caller has it), and its
        reply; a POST while the channel is not open."""
        ws, key = self._ws, (command.action.value, command.epoch)
        if ws is None or ws.closed or key in self._answers:
            return await self.client.send(self.endpoint, command)
        answer: asyncio.Future[CommandOutcome] = asyncio.get_running_loop().create_future()
        self._answers[key] = answer  # before the write: its reply may be read while the write waits
        try:
            await ws.send_str(frame if frame is not None else command_frame(command))
            return await asyncio.wait_for(answer, COMMAND_SECONDS)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as err:
            return _unreachable(self.endpoint.pod, key[0], repr(err))
        finally:
            if self._answers.get(key) is answer:
                del self._answers[key]

    def _answered(self, reply: CommandReply) -> None:
        if reply.action is None or reply.epoch is None:
            return  # not an answer to one of ours: the operator sends only valid commands
        answer = self._answers.pop((reply.action.value, reply.epoch), None)
        if answer is not None and not answer.done():
            answer.set_result(_outcome(self.endpoint.pod, reply.action.value, reply.status, reply.refusal))

    def _unanswered(self, why: str) -> None:
        for (action, _), answer in self._answers.items():
            if not answer.done():
                answer.set_result(_unreachable(self.endpoint.pod, action, why))
        self._answers.clear()

    def _take(self, state: AgentState) -> None:
        if state.boot_id != self._boot:  # a restarted agent starts its revisions again
            self._boot, self._since = state.boot_id, -1
        if self._since < 0 or state.revision > self._since:
            # Reports only move forward: an older revision from the same boot is dropped.
            self.latest = state
            self._since = state.revision
            AGENT_REPORTS.inc()
            self._wake()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._follow_channel()
                failures = 0
            except (TimeoutError, aiohttp.ClientError, HttpProcessingError, ValidationError) as err:
                failures += 1
                log.debug("agent %s: %r", self.endpoint.pod, err)
            await asyncio.sleep(min(2.0, 0.1 * max(1, failures)))

    async def _follow_channel(self) -> None:
        async with self.client.channel(self.endpoint, self._since, self._boot) as ws:
            self._ws = ws
            try:
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    frame = ChannelFrame.model_validate_json(msg.data)
                    if frame.state is not None:
                        self._take(frame.state)
                    elif frame.reply is not None:
                        self._answered(frame.reply)
            finally:
                self._ws = None
                self._unanswered("the agent's channel closed")  # commands sent on it: no answer comes

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
