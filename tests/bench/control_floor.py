"""The floor of one lock-step transition, measured on the benchmark's own agents (run by
bench_control_overhead.py after a job succeeded and its operator stopped, as a process of its own):

    python tests/bench/control_floor.py REQUEST.json RESULT.json

A transition is the least any operator must do: send one small command (drain, then resume, epochs
counting on from the job's) to every agent at once, take each agent's report of the finished command, and
write one status merge-patch once the last report came. It runs on the operator's own path, so that the
floor costs what the operator's transport and parsing cost and no more:
- the agents: `controller/agent_client.py` (an `AgentWatch` per agent: its channel, `GET /v1/channel`,
  opened before the first command; each frame validated as the operator validates it; the command as one
  frame written to every channel, `command_frame`, as the conductor does);
- the status: `controller/kube.py` `Kube.patch_status` over the shared client (kubeclient/apiserver.py),
  to an RLJob that carries the benchmark job's final status, with what a phase change of the operator
  changes (phase, epoch, phaseStartTime, reason, message, and the timeline, conditions and pods lists,
  which a merge patch replaces whole).
Its floor is that wall time minus the slowest agent's own time for the command (`lastCommand.seconds`), as
the operator's overhead is the phase's wall time minus `agentSeconds`.

REQUEST: {"agents": [[pod, ip, port], ...], "token": str, "epoch": int (the job's last), "pairs": int,
"kubeconfig": path, "namespace": str, "name": str (an RLJob no operator watches: its status is patched),
"status": the job's final status (the floor RLJob already carries it)}.
RESULT: {"samples": [{"action", "wall", "in_agent", "patch"}], "cpu": seconds of this process over the
transitions, "seconds": their wall time, "busy": the machine's busy CPU seconds over them (/proc/stat)}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rljob import event_loop
from rljob.api.agent import Action, AgentState, CommandState, DrainCommand, ResumeCommand
from rljob.controller.agent_client import AgentClient, AgentEndpoint, AgentWatch, command_frame
from rljob.controller.kube import Kube, api_server
from rljob.kubeclient.credentials import Credentials

COMMAND_SECONDS = 120.0  # a transition that takes longer fails the floor


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle, since boot (bench_control_overhead.py's twin)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _seconds(state: AgentState | None) -> float:
    """The agent's own time for its last command."""
    cmd = state.last_command if state is not None else None
    return (cmd.seconds or 0.0) if cmd is not None else 0.0


class Floor:
    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.endpoints = [AgentEndpoint(pod, "", ip, port) for pod, ip, port in req["agents"]]
        self.kube = Kube(api_server(Credentials.from_kubeconfig(req["kubeconfig"])))
        self.epoch = int(req["epoch"])
        self.watches: list[AgentWatch] = []
        self.done = asyncio.Event()

    def _finished(self, state: AgentState | None) -> bool:
        cmd = state.last_command if state is not None else None
        return cmd is not None and cmd.epoch == self.epoch and cmd.state != CommandState.RUNNING

    def _wake(self) -> None:
        if all(self._finished(w.latest) for w in self.watches):
            self.done.set()

    async def transition(self, action: Action) -> dict[str, Any]:
        self.epoch += 1
        self.done.clear()
        command: DrainCommand | ResumeCommand = (
            DrainCommand(epoch=self.epoch) if action == Action.DRAIN else ResumeCommand(epoch=self.epoch)
        )
        frame = command_frame(command)
        began = time.perf_counter()
        outcomes = await asyncio.gather(*(w.send(command, frame) for w in self.watches))
        refused = [o for o in outcomes if not o.accepted]
        if refused:
            raise RuntimeError(f"{action.value} {self.epoch}: {refused[0]}")
        await asyncio.wait_for(self.done.wait(), COMMAND_SECONDS)
        reported = time.perf_counter()
        await self.kube.patch_status(self.req["namespace"], self.req["name"], self._phase_change(action))
        ended = time.perf_counter()
        in_agent = max(_seconds(w.latest) for w in self.watches)
        wall, patched = ended - began, ended - reported
        return {"action": action.value, "wall": wall, "in_agent": in_agent, "patch": patched}

    def _phase_change(self, action: Action) -> dict[str, Any]:
        """What the operator's merge patch holds when the job enters a phase (status_writer.merge_patch of
        two consecutive statuses): the scalars, and the lists it changes, replaced whole."""
        status = self.req.get("status") or {}
        phase = {Action.DRAIN: "Draining", Action.RESUME: "Resuming"}[action]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        timeline = [*status.get("timeline", [])[1:], {"phase": phase, "iteration": 1, "startTime": now}]
        conditions = [{**c, "lastTransitionTime": now} for c in status.get("conditions", [])]
        stage = "Drained" if action == Action.DRAIN else "Serving"
        pods = [{**p, "stage": stage} for p in status.get("pods", [])]
        return {
            "phase": phase, "epoch": self.epoch, "phaseStartTime": now, "reason": "PhaseChanged",
            "message": f"floor: {phase}", "timeline": timeline, "conditions": conditions, "pods": pods,
        }  # fmt: skip

    async def run(self) -> dict[str, Any]:
        async with AgentClient(self.req["token"]) as client:
            self.watches = [AgentWatch(client, e, self._wake) for e in self.endpoints]
            try:
                while any(w.latest is None for w in self.watches):  # every channel open before a command
                    await asyncio.sleep(0.05)
                times, busy, began = os.times(), machine_busy_seconds(), time.monotonic()
                samples = []
                for _ in range(int(self.req["pairs"])):
                    for action in (Action.DRAIN, Action.RESUME):
                        samples.append(await self.transition(action))
                after = os.times()
                return {
                    "samples": samples,
                    "cpu": after.user + after.system - times.user - times.system,
                    "seconds": time.monotonic() - began,
                    "busy": machine_busy_seconds() - busy,
                }
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
