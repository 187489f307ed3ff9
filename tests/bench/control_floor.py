"""The floor of one lock-step transition, measured on the benchmark's own agents (run by
bench_control_overhead.py after a job succeeded and its operator stopped, as a process of its own):

    python tests/bench/control_floor.py REQUEST.json RESULT.json

A transition is the least any operator must do: send one small command to every agent at once, take each
agent's report of the finished command, and write one status merge-patch once the last report came. The
floor runs the operator's whole command cycle, so that each agent does for each command what it does in the
job (a resume after a release resumes memory; a drain after a refit drains a fresh server): per round
drain, release, grant, refit, resume, each built by its row in lifecycle/lock_steps.py from the job's
spec and status (epochs counting on from the job's). The job's trainers still run (they train until
stopped): as in the job, a drain waits until every trainer asked for the GPU after its rollout, and a refit
until every trainer published, and loads what each published. Those waits are not timed: they are the
Rollout and Training phases. It runs on the operator's own path, so that the floor costs what the
operator's transport and parsing cost and no more:
- the agents: `controller/agent_client.py` (an `AgentWatch` per agent: its channel, `GET /v1/channel`,
  opened before the first command; each frame validated as the operator validates it; a command as one
  frame per distinct command, `command_frame`, as the conductor does);
- the status: `controller/kube.py` `Kube.patch_status` over the shared client (kubeclient/apiserver.py),
  to an RLJob that carries the benchmark job's final status, with what a phase change of the operator
  changes (phase, epoch, phaseStartTime, reason, message, and the timeline, conditions and pods lists,
  which a merge patch replaces whole).
Its floor is that wall time minus the slowest agent's own time for the command (`lastCommand.seconds`), as
the operator's overhead is the phase's wall time minus `agentSeconds`.

REQUEST: {"agents": [[pod, ip, port], ...], "token": str,
"job": the RLJob (its spec and status build the commands; its status.epoch is the last), "rounds":
int, "kubeconfig": path, "namespace": str, "name": str (an RLJob no operator watches: its status is patched),
"status": the job's final status (the floor RLJob already carries it)}.
RESULT: {"samples": [{"action", "wall", "in_agent", "patch"}], "cpu": seconds of this process over the
transitions, "seconds": their wall time, "busy": the machine's busy CPU
seconds over them (/proc/stat)}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rljob import event_loop
from rljob.api import parse_job
from rljob.api.agent import Action, AgentState, Command, CommandState, CommandStatus, Stage
from rljob.api.resource import parse_status
from rljob.api.status import CommittedWeights, Phase
from rljob.controller.agent_client import AgentClient, AgentEndpoint, AgentWatch, command_frame
from rljob.controller.kube import Kube, api_server
from rljob.kubeclient.credentials import Credentials
from rljob.lifecycle.lock_steps import LOCK_STEPS
from rljob.lifecycle.model import Observation
from rljob.lifecycle.roles import Role
from rljob.lifecycle.step import Step

COMMAND_SECONDS = 120.0  # a transition that takes longer fails the floor
CYCLE = (Action.DRAIN, Action.RELEASE, Action.GRANT, Action.REFIT, Action.RESUME)  # the operator's order
# The job's phase while each command runs, and the stage its pods reach (the status patch's contents).
PHASE = {Action.DRAIN: "Draining", Action.RELEASE: "Releasing", Action.GRANT: "Training",
         Action.REFIT: "Refitting", Action.RESUME: "Resuming"}  # fmt: skip
STAGE = {Action.DRAIN: "Drained", Action.RELEASE: "Released", Action.GRANT: "Granted",
         Action.REFIT: "Refitted", Action.RESUME: "Serving"}  # fmt: skip


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle, since boot (bench_control_overhead.py's twin)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _last(state: AgentState | None) -> CommandStatus | None:
    return state.last_command if state is not None else None


def _seconds(state: AgentState | None) -> float:
    """The agent's own time for its last command."""
    cmd = _last(state)
    return (cmd.seconds or 0.0) if cmd is not None else 0.0


class Floor:
    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.endpoints = [AgentEndpoint(pod, "", ip, port) for pod, ip, port in req["agents"]]
        self.kube = Kube(api_server(Credentials.from_kubeconfig(req["kubeconfig"])))
        self.spec = parse_job(req["job"])
        self.status = parse_status(req["job"]["status"])
        self.epoch = self.status.epoch
        self.watches: list[AgentWatch] = []
        self.done = asyncio.Event()
        self.until: Callable[[AgentState], bool] = self._finished  # what `done` waits for on every agent
        self.cpu = self.seconds = self.busy = 0.0  # over the transitions only, not the waits between them

    def _finished(self, state: AgentState | None) -> bool:
        cmd = _last(state)
        return cmd is not None and cmd.epoch == self.epoch and cmd.state != CommandState.RUNNING

    def _wake(self) -> None:
        if all(w.latest is not None and self.until(w.latest) for w in self.watches):
            self.done.set()

    async def _every_agent(self, until: Callable[[AgentState], bool]) -> None:
        self.done.clear()
        self.until = until
        self._wake()
        await asyncio.wait_for(self.done.wait(), COMMAND_SECONDS)

    def _command(self, action: Action, agent: AgentState) -> Command:
        """What the phase's row in lifecycle/lock_steps.py sends a leader, at the floor's epoch; a refit
        targets the version the pod's own trainer published (so it loads that trainer's path)."""
        status = self.status.model_copy(update={"epoch": self.epoch})
        if action == Action.REFIT:
            version = agent.trainer.published_version
            assert version is not None
            status.target_weights = CommittedWeights(version=version, iteration=status.iteration + 1)
        step = Step(
            job_spec=self.spec, status=status, obs=Observation(now=datetime.now(UTC)), rows=LOCK_STEPS
        )
        return LOCK_STEPS[Phase(PHASE[action])].command(step, agent, Role.LEADER)

    async def transition(self, action: Action) -> dict[str, Any]:
        self.epoch += 1
        self.done.clear()
        self.until = self._finished
        commands = [self._command(action, w.latest) for w in self.watches if w.latest is not None]
        frames: dict[str, str] = {}  # one frame per distinct command, as the conductor writes them
        keyed = [frames.setdefault(c.model_dump_json(), command_frame(c)) for c in commands]
        times, busy = os.times(), machine_busy_seconds()
        began = time.perf_counter()
        outcomes = await asyncio.gather(
            *(w.send(c, f) for w, c, f in zip(self.watches, commands, keyed, strict=True))
        )
        refused = [o for o in outcomes if not o.accepted]
        if refused:
            raise RuntimeError(f"{action.value} {self.epoch}: {refused[0]}")
        await asyncio.wait_for(self.done.wait(), COMMAND_SECONDS)
        reported = time.perf_counter()
        await self.kube.patch_status(self.req["namespace"], self.req["name"], self._phase_change(action))
        ended = time.perf_counter()
        after = os.times()
        self.cpu += after.user + after.system - times.user - times.system
        self.busy += machine_busy_seconds() - busy
        self.seconds += ended - began
        failed = [c for w in self.watches if (c := _last(w.latest)) and c.state != CommandState.SUCCEEDED]
        if failed:
            raise RuntimeError(f"{action.value} {self.epoch} failed: {failed[0].error}")
        in_agent = max(_seconds(w.latest) for w in self.watches)
        wall, patched = ended - began, ended - reported
        return {"action": action.value, "wall": wall, "in_agent": in_agent, "patch": patched}

    def _phase_change(self, action: Action) -> dict[str, Any]:
        """What the operator's merge patch holds when the job enters a phase (status_writer.merge_patch of
        two consecutive statuses): the scalars, and the lists it changes, replaced whole."""
        status = self.req.get("status") or {}
        phase = PHASE[action]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        timeline = [*status.get("timeline", [])[1:], {"phase": phase, "iteration": 1, "startTime": now}]
        conditions = [{**c, "lastTransitionTime": now} for c in status.get("conditions", [])]
        pods = [{**p, "stage": STAGE[action]} for p in status.get("pods", [])]
        return {
            "phase": phase, "epoch": self.epoch, "phaseStartTime": now, "reason": "PhaseChanged",
            "message": f"floor: {phase}", "timeline": timeline, "conditions": conditions, "pods": pods,
        }  # fmt: skip

    async def round(self) -> list[dict[str, Any]]:
        """One command cycle, each command once its agents are where the job's would be."""
        samples = []
        for action in CYCLE:
            if action == Action.DRAIN:  # the rollout's end: every trainer asked for the GPU
                await self._every_agent(lambda s: s.trainer.requested)
            if action == Action.REFIT:  # the training's end: every trainer published
                await self._every_agent(lambda s: s.stage == Stage.TRAINED)
            samples.append(await self.transition(action))
        return samples

    async def run(self) -> dict[str, Any]:
        async with AgentClient(self.req["token"]) as client:
            self.watches = [AgentWatch(client, e, self._wake) for e in self.endpoints]
            try:
                while any(w.latest is None for w in self.watches):  # every channel open before a command
                    await asyncio.sleep(0.05)
                samples = []
                for _ in range(int(self.req["rounds"])):
                    samples += await self.round()
                return {"samples": samples, "cpu": self.cpu, "seconds": self.seconds, "busy": self.busy}
            finally:
                await asyncio.gather(*(w.close() for w in self.watches))


def main() -> None:
    floor = Floor(json.loads(Path(sys.argv[1]).read_text()))

    async def measure() -> dict[str, Any]:
        try:
            return await floor.run()
        finally:
            await floor.kube.close()

    result = event_loop.run(measure())  # the operator's loop: uvloop where it is installed
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
