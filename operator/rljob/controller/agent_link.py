"""The operator's side of the agent protocol for one RLJob: which agents it follows (those of placed gangs),
their latest states, whether an awaited pod took its command, the commands sent and the refusals kept for
the next decision. The conductor holds an AgentLink; AgentChannels is the one over the agents' channels
(controller/agent_client.py), a fake in the unit tests is another."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from rljob.api.agent import AgentState, Command
from rljob.api.spec import RLJobSpec
from rljob.controller.agent_client import (
    AgentClient,
    AgentEndpoint,
    AgentWatch,
    CommandOutcome,
    command_frame,
)
from rljob.controller.pod_cache import PodCache
from rljob.lifecycle.model import AgentRefusal, Awaited, Decision

CommandKey = tuple[str, str, int]  # (pod uid, action, epoch): one command to one incarnation of a pod


@dataclass(frozen=True)
class Sent:
    """What sending a decision's commands did."""

    progressed: bool  # an agent accepted a command, or refused one for the first time
    not_taken: bool  # some command was not accepted: the next decision sends it again


class Channel(Protocol):
    """One agent as the link follows it: its latest state, and commands sent to it (AgentWatch)."""

    endpoint: AgentEndpoint
    latest: AgentState | None

    async def send(self, command: Command, frame: str | None = None) -> CommandOutcome: ...

    async def close(self) -> None: ...


# Opens a channel to the agent at an endpoint; the callable is called on each new report.
OpenChannel = Callable[[AgentClient, AgentEndpoint, Callable[[], None]], Channel]


class AgentLink(Protocol):
    def authorize(self, token: str) -> None:
        """The job's agent token (its Secret exists): every call from now on carries it."""

    def follow(self, pods: PodCache, spec: RLJobSpec | None, reported: Callable[[str], None]) -> None:
        """Follow the agents of `pods` that should be followed (none while `spec` is None: the job is
        failing); `reported(pod)` is called on each new report."""

    def states(self, pods: PodCache) -> dict[str, AgentState | None]:
        """Each pod's latest report, None where none came from that pod (a recreated pod has a new uid)."""

    def latest(self, pod: str) -> AgentState | None:
        """The latest report from `pod`'s agent, whichever pod uid it came from."""

    def took(self, awaited: Awaited) -> bool:
        """The pod's agent accepted the awaited command (its report may not show it yet)."""

    def pending_refusals(self) -> tuple[AgentRefusal, ...]:
        """The refusals the next decision gets."""

    def take_refusals(self) -> tuple[AgentRefusal, ...]:
        """The refusals for the decision being made; each reaches exactly one decision (one event)."""

    async def send(self, decision: Decision) -> Sent:
        """Send the decision's commands that no agent accepted yet; keep their refusals."""

    async def close(self) -> None: ...


class AgentChannels:
    """An AgentLink over one channel per agent: an AgentWatch (the agent's channel, a POST while it is not
    open), or what `open_channel` opens instead (tests/unit/test_conductor_agents.py)."""

    def __init__(self, client: AgentClient | None = None, open_channel: OpenChannel = AgentWatch) -> None:
        self._client = client or AgentClient()
        self._open_channel = open_channel
        self._watches: dict[str, Channel] = {}
        self._watched: tuple[int, RLJobSpec | None] | None = None  # (pods.version, spec) watches follow
        self._placed: set[int] = set()  # gangs (status.restarts) the scheduler placed whole
        self._accepted: set[CommandKey] = set()  # commands an agent took
        # Refusals for the next decision, and those already reported: a command re-sent each round and
        # refused each time is one event, not one per round.
        self._refusals: list[AgentRefusal] = []
        self._refused: set[tuple[str, str, int, str]] = set()

    def authorize(self, token: str) -> None:
        self._client.token = token

    # --- following -----------------------------------------------------------------------------------

    def follow(self, pods: PodCache, spec: RLJobSpec | None, reported: Callable[[str], None]) -> None:
        """One watch per agent of a placed gang (none while the spec is invalid: the job is failing). The
        first watch request is what lets the agent's startupProbe pass (agent/operator_api.py,
        /probe/gang): no member of a gang the scheduler could not place whole starts its engine or
        its trainer."""
        if self._watched is not None and self._watched[0] == pods.version and self._watched[1] is spec:
            return
        self._watched = (pods.version, spec)
        wanted = self._wanted(pods, spec) if spec is not None else {}
        for name in list(self._watches):
            if name not in wanted or self._watches[name].endpoint != wanted[name]:
                watch = self._watches.pop(name)
                asyncio.get_running_loop().create_task(watch.close())
        self._client.open()
        for name, endpoint in wanted.items():
            if name not in self._watches:
                wake = functools.partial(reported, name)
                self._watches[name] = self._open_channel(self._client, endpoint, wake)

    def _wanted(self, pods: PodCache, spec: RLJobSpec) -> dict[str, AgentEndpoint]:
        """The agents of live pods of placed gangs, by pod name."""
        wanted: dict[str, AgentEndpoint] = {}
        placed = self._placed_gangs(pods, spec)
        for pod in pods.pods():
            obs = pod.observation
            alive = obs.phase in ("Pending", "Running") and not obs.deleting
            if pod.ip and alive and obs.gang in placed:
                wanted[pod.name] = AgentEndpoint(pod.name, pod.uid, pod.ip, spec.agent.port)
        return wanted

    def _placed_gangs(self, pods: PodCache, spec: RLJobSpec) -> set[int]:
        """Gangs every member of which the scheduler placed (each has a pod IP), at any time so far."""
        members: dict[int, int] = {}
        for pod in pods.pods():
            if pod.ip and not pod.observation.deleting:
                members[pod.observation.gang] = members.get(pod.observation.gang, 0) + 1
        self._placed.update(g for g, n in members.items() if n >= spec.replicas)
        return self._placed

    # --- reading -------------------------------------------------------------------------------------

    def states(self, pods: PodCache) -> dict[str, AgentState | None]:
        states: dict[str, AgentState | None] = {}
        for pod in pods.pods():
            watch = self._watches.get(pod.name)
            # A report counts only for the pod it came from: a recreated pod has a new uid.
            fresh = watch is not None and watch.endpoint.uid == pod.uid
            states[pod.name] = watch.latest if fresh and watch else None
        return states

    def latest(self, pod: str) -> AgentState | None:
        watch = self._watches.get(pod)
        return watch.latest if watch is not None else None

    def took(self, awaited: Awaited) -> bool:
        watch = self._watches.get(awaited.pod)
        key = (watch.endpoint.uid, awaited.action.value, awaited.epoch) if watch is not None else None
        return key in self._accepted

    def pending_refusals(self) -> tuple[AgentRefusal, ...]:
        return tuple(self._refusals)

    def take_refusals(self) -> tuple[AgentRefusal, ...]:
        taken = tuple(self._refusals)
        self._refusals.clear()
        return taken

    # --- sending -------------------------------------------------------------------------------------

    async def send(self, decision: Decision) -> Sent:
        """Fan out concurrently. A command an agent accepted is not sent again while its state report
        catches up (the agent's reports do not show an acceptance)."""
        epoch = decision.status.epoch
        self._accepted = {a for a in self._accepted if a[2] >= epoch}
        self._refused = {r for r in self._refused if r[2] >= epoch}
        keys, sends = self._sends(decision)
        progressed = not_taken = False
        for key, outcome in zip(keys, await asyncio.gather(*sends), strict=True):
            if outcome.accepted:
                self._accepted.add(key)
                progressed = True
                continue
            not_taken = True  # it is sent again by the next decision
            progressed = self._keep_refusal(key, outcome) or progressed
        return Sent(progressed, not_taken)

    def _sends(
        self, decision: Decision
    ) -> tuple[list[CommandKey], list[Coroutine[Any, Any, CommandOutcome]]]:
        """The decision's commands not yet accepted, each with its (pod uid, action, epoch)."""
        keys, sends = [], []
        frames: dict[int, str] = {}  # by id(): a decision builds one command per role (LockStep.varies)
        for pc in decision.commands:
            watch = self._watches.get(pc.pod)
            if watch is None:
                continue
            key = (watch.endpoint.uid, pc.command.action.value, pc.command.epoch)
            if key in self._accepted:
                continue
            frame = frames.get(id(pc.command))
            if frame is None:
                frame = frames[id(pc.command)] = command_frame(pc.command)
            sends.append(watch.send(pc.command, frame))
            keys.append(key)
        return keys, sends

    def _keep_refusal(self, key: CommandKey, outcome: CommandOutcome) -> bool:
        """Keep a refusal for the next decision (an event) unless it was reported already; True when kept.
        A permanent refusal reaches every decision until one is stored: it fails the job."""
        refusal = outcome.refusal
        if not refusal or refusal.startswith("unreachable"):
            return False
        if not outcome.permanent and (*key, refusal) in self._refused:
            return False
        self._refused.add((*key, refusal))
        self._refusals.append(AgentRefusal(outcome.pod, refusal, outcome.error, outcome.permanent))
        return True

    async def close(self) -> None:
        for watch in self._watches.values():
            await watch.close()
        self._watches.clear()
        await self._client.close()
