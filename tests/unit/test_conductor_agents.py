"""The conductor's agent behaviour (controller/agent_link.py AgentChannels, as the conductor runs it), over
a fake link: AgentChannels whose channels are fake agents (lifecycle_world.FakeAgent), which take or
refuse a command by the desk's own rules (agent/commands.py is_new, agent/actions.py guards). A fake Kube
answers each pod created as running; decide(), the pacer and the status writer are the real ones.

- a command an agent accepted is sent once, while its report does not show it yet;
- a refusal repeated every round is one event;
- a permanent refusal fails the job;
- an accepted command waits: a report that does not show it yet decides nothing."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from lifecycle_world import FakeAgent
from test_conductor_refusals import body
from test_pod_cache import ListingKube, counted_decisions

from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.api.agent import AgentState, Command, GroupState
from rljob.controller.agent_client import AgentClient, AgentEndpoint, CommandOutcome
from rljob.controller.agent_link import AgentChannels
from rljob.controller.conductor import Conductor, ConductorOptions

REPLICAS = 2


class RunningKube(ListingKube):
    """Every pod created is placed and running at once, with an IP."""

    async def create(self, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False) -> Any:
        created = await super().create(namespace, manifest, dry_run=dry_run)
        if isinstance(created, dict) and manifest["kind"] == "Pod" and not dry_run:
            index = len([n for n in self.store if n != manifest["metadata"]["name"]])
            created["status"] = {
                "phase": "Running",
                "podIP": f"10.0.0.{index + 1}",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
        return created


class FakeChannel:
    """One pod's agent as the link sees it (a Channel): its reports, and its answers to commands.
    `reports_acceptance`: after taking a command its next report shows it (else the report lags)."""

    def __init__(self, agent: FakeAgent, endpoint: AgentEndpoint, wake: Callable[[], None]) -> None:
        self.agent, self.endpoint, self._wake = agent, endpoint, wake
        self.latest: AgentState | None = agent.report()
        self.sent: list[Command] = []
        self.reports_acceptance = False
        asyncio.get_running_loop().call_soon(wake)

    async def send(self, command: Command, frame: str | None = None) -> CommandOutcome:
        self.sent.append(command)
        refused = self.agent.accept(command)
        if refused is not None:  # as agent_client._outcome words a 409
            why = f"HTTP {refused.status}: {refused.reason}"
            return CommandOutcome(self.endpoint.pod, False, why, refused.error, refused.permanent)
        if self.reports_acceptance:
            self.report()
        return CommandOutcome(self.endpoint.pod, True)

    def report(self, state: AgentState | None = None) -> None:
        """The agent reports its state, or `state` (one from before its latest change) with a new
        revision."""
        self.agent.revision += 1
        now = self.agent.report()
        self.latest = now if state is None else state.model_copy(update={"revision": now.revision})
        self._wake()

    async def close(self) -> None:
        pass


class FakeAgents:
    """The fake link's channels: one FakeChannel per pod, over an agent of `kind` serving the job's
    initial weights."""

    def __init__(self, kind: type[FakeAgent] = FakeAgent) -> None:
        self.kind = kind
        self.channels: dict[str, FakeChannel] = {}

    def open(self, client: AgentClient, endpoint: AgentEndpoint, wake: Callable[[], None]) -> FakeChannel:
        agent = self.kind(served_version=body()["spec"]["weights"]["initialVersion"])
        channel = self.channels[endpoint.pod] = FakeChannel(agent, endpoint, wake)
        return channel

    def sent(self) -> dict[str, list[str]]:
        return {pod: [c.action.value for c in ch.sent] for pod, ch in self.channels.items()}


class GroupPendingAgent(FakeAgent):
    """Its trainer's weight-update group is still forming: every command is refused Busy (a conflict:
    the same command may be taken later)."""

    def report(self) -> AgentState:
        state = super().report()
        state.trainer.weights_group = GroupState.PENDING
        return state


class DataParallelAttentionAgent(FakeAgent):
    """SGLang runs --enable-dp-attention: every command is refused for good (forbidden by the launch)."""

    def facts(self) -> SGLangFacts:
        return dataclasses.replace(super().facts(), dp_attention=True)


@dataclasses.dataclass
class Conducted:
    kube: RunningKube
    agents: FakeAgents
    conductor: Conductor
    decisions: list[Any]


def conductor(monkeypatch: Any, agents: FakeAgents, tick: float = 0.01, quiet: float = 0.02) -> Conducted:
    decisions = counted_decisions(monkeypatch)
    kube = RunningKube()
    job = body()
    job["spec"]["replicas"] = REPLICAS
    link = AgentChannels(open_channel=agents.open)
    options = ConductorOptions(tick_seconds=tick, quiet_seconds=quiet)
    return Conducted(kube, agents, Conductor(kube, job, options, agents=link), decisions)  # type: ignore[arg-type]


async def conducting(c: Conducted, scenario: Callable[[], Awaitable[None]]) -> None:
    """Run the conductor while `scenario` runs, then stop it."""
    stop = False
    task = asyncio.create_task(c.conductor.run(lambda: stop))
    try:
        await scenario()
    finally:
        stop = True
        c.conductor.poke()
        await asyncio.wait_for(task, 5)


async def until(done: Callable[[], bool], seconds: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.01)


def resumes_sent(c: Conducted) -> int:
    return sum(actions.count("resume") for actions in c.agents.sent().values())


def test_a_command_an_agent_accepted_is_sent_once_while_its_report_lags(monkeypatch: Any) -> None:
    """The agents take the resume and do not report it: decision after decision (one due every 20 ms)
    has it again, and the link sends it to each pod once."""
    c = conductor(monkeypatch, FakeAgents())

    async def scenario() -> None:
        await until(lambda: resumes_sent(c) >= REPLICAS)
        after = len(c.decisions)
        await until(lambda: len(c.decisions) > after + 10)

    asyncio.run(conducting(c, scenario))
    assert c.kube.status["phase"] == "Resuming", c.kube.status
    assert len(c.decisions) > 10
    assert c.agents.sent() == {f"demo-{i}": ["resume"] for i in range(REPLICAS)}


def test_a_refusal_repeated_every_round_is_one_event(monkeypatch: Any) -> None:
    c = conductor(monkeypatch, FakeAgents(GroupPendingAgent))
    asyncio.run(conducting(c, lambda: until(lambda: resumes_sent(c) >= 5 * REPLICAS)))
    assert resumes_sent(c) >= 5 * REPLICAS, c.agents.sent()  # sent again and refused again, round by round
    events = [m for _, r, m in c.kube.events if r == "CommandRefused"]
    assert len(events) == REPLICAS, events  # one per pod
    assert all("init_weights_update_group is still waiting" in m for m in events), events
    assert c.kube.status["phase"] == "Resuming", c.kube.status


def test_a_permanent_refusal_fails_the_job(monkeypatch: Any) -> None:
    c = conductor(monkeypatch, FakeAgents(DataParallelAttentionAgent))
    asyncio.run(conducting(c, lambda: until(lambda: c.kube.status.get("phase") == "Failed")))
    status = c.kube.status
    assert status.get("phase") == "Failed", status
    assert "--enable-dp-attention" in status["message"], status


def test_an_accepted_command_waits_for_its_report(monkeypatch: Any) -> None:
    """The agents take the resume; a report that does not show it yet (sent before the agent took it,
    read after the answer) wakes no decision: the link knows the command was taken. Nothing is due
    meanwhile (the tick and the quiet decision are 30 s away)."""
    c = conductor(monkeypatch, FakeAgents(), tick=30, quiet=30)

    async def scenario() -> None:
        await until(lambda: resumes_sent(c) >= REPLICAS)
        await asyncio.sleep(0.3)
        settled = len(c.decisions)
        for channel in c.agents.channels.values():
            assert channel.latest is not None and channel.latest.last_command is None
            channel.report(channel.latest)  # the state before the resume, a new revision
        await asyncio.sleep(0.3)
        assert len(c.decisions) == settled, c.decisions[settled:]
        for channel in c.agents.channels.values():  # the resume finished everywhere: decided on
            channel.agent.finish()
            channel.report()
        await until(lambda: c.kube.status["phase"] == "Rollout", 1)
        assert c.kube.status["phase"] == "Rollout", c.decisions[settled:]

    asyncio.run(conducting(c, scenario))
    assert resumes_sent(c) == REPLICAS, c.agents.sent()
