"""The floor of one lock-step transition, measured on the benchmark's own agents (run by
bench_control_overhead.py after a job succeeded and its operator stopped, as a process of its own):

    python tests/bench/control_floor.py REQUEST.json RESULT.json

A transition is the least any operator must do: POST one small command (drain, then resume, epochs
counting on from the job's) to every agent at once, take each agent's report of the finished command
over the state stream already open (`GET /v1/state?changes=operator&watch=true`, the operator's
channel: a line each, JSON parsed, nothing validated), and
write one status merge-patch (kubernetes client, as the operator does) once the last report came: to an
RLJob that carries the benchmark job's final status, and of what a phase change of the operator
changes (phase, epoch, phaseStartTime, reason, message, and the timeline, conditions and pods lists,
which a merge patch replaces whole). Its
floor is that wall time minus the slowest agent's own time for the command (`lastCommand.seconds`), as
the operator's overhead is the phase's wall time minus `agentSeconds`.

REQUEST: {"agents": [[ip, port], ...], "token": str, "epoch": int (the job's last), "pairs": int,
"kubeconfig": path, "namespace": str, "name": str (an RLJob no operator watches: its status is patched),
"status": the job's final status (the floor RLJob already carries it)}.
RESULT: {"samples": [{"action", "wall", "in_agent", "patch"}], "cpu": seconds of this process over the
transitions}.
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

import aiohttp
from kubernetes import client, config

from rljob.api.crd import GROUP, PLURAL, VERSION

LONG_POLL = 10.0


class Floor:
    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.urls = [f"http://{ip}:{port}" for ip, port in req["agents"]]
        self.headers = {"Authorization": f"Bearer {req['token']}"}
        self.latest: list[dict[str, Any] | None] = [None] * len(self.urls)
        self.pending: set[int] = set()
        self.epoch = 0
        self.cpu = 0.0
        self.done = asyncio.Event()
        self.custom = client.CustomObjectsApi(config.new_client_from_config(req["kubeconfig"]))

    def _finished(self, state: dict[str, Any]) -> bool:
        cmd = state.get("lastCommand") or {}
        return bool(cmd.get("epoch") == self.epoch and cmd.get("state") != "Running")

    async def poll(self, session: aiohttp.ClientSession, i: int) -> None:
        since, boot = -1, None
        while True:
            params = {"since": str(since), "wait": str(LONG_POLL), "changes": "operator", "watch": "true"}
            if boot:
                params["boot"] = boot
            async with session.get(f"{self.urls[i]}/v1/state", params=params, headers=self.headers) as resp:
                resp.raise_for_status()
                while line := await resp.content.readline(max_line_length=2**22):
                    if line.strip():
                        self._reported(i, json.loads(line))
                        boot, since = self.latest[i]["bootId"], self.latest[i]["revision"]

    def _reported(self, i: int, state: dict[str, Any]) -> None:
        self.latest[i] = state
        if i in self.pending and self._finished(state):
            self.pending.discard(i)
            if not self.pending:
                self.done.set()

    async def transition(self, session: aiohttp.ClientSession, action: str) -> dict[str, Any]:
        self.epoch += 1
        self.pending = set(range(len(self.urls)))
        self.done.clear()
        body = {"action": action, "epoch": self.epoch}
        began = time.perf_counter()

        async def send(url: str) -> None:
            async with session.post(f"{url}/v1/commands", json=body, headers=self.headers) as resp:
                if resp.status not in (200, 202):
                    text = await resp.text()
                    raise RuntimeError(f"{url}: {action} {self.epoch}: HTTP {resp.status} {text}")

        await asyncio.gather(*(send(u) for u in self.urls))
        await asyncio.wait_for(self.done.wait(), 120)
        reported = time.perf_counter()
        patch = {"status": self._phase_change(action)}
        ns, name = self.req["namespace"], self.req["name"]
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, ns, PLURAL, name, patch
        )
        ended = time.perf_counter()
        in_agent = max((s or {}).get("lastCommand", {}).get("seconds") or 0.0 for s in self.latest)
        return {"action": action, "wall": ended - began, "in_agent": in_agent, "patch": ended - reported}

    def _phase_change(self, action: str) -> dict[str, Any]:
        """What the operator's merge patch holds when the job enters a phase (status_writer.merge_patch of
        two consecutive statuses): the scalars, and the lists it changes, replaced whole."""
        status = self.req.get("status") or {}
        phase = {"drain": "Draining", "resume": "Resuming"}[action]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        timeline = [*status.get("timeline", [])[1:], {"phase": phase, "iteration": 1, "startTime": now}]
        conditions = [{**c, "lastTransitionTime": now} for c in status.get("conditions", [])]
        pods = [{**p, "stage": "Drained" if action == "drain" else "Serving"} for p in status.get("pods", [])]
        return {
            "phase": phase, "epoch": self.epoch, "phaseStartTime": now, "reason": "PhaseChanged",
            "message": f"floor: {phase}", "timeline": timeline, "conditions": conditions, "pods": pods,
        }  # fmt: skip

    async def run(self) -> list[dict[str, Any]]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=LONG_POLL + 30, connect=5)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.epoch = int(self.req["epoch"])
            polls = [asyncio.create_task(self.poll(session, i)) for i in range(len(self.urls))]
            while any(s is None for s in self.latest):  # every long-poll open once before the first POST
                await asyncio.sleep(0.05)
            samples = []
            times = os.times()
            self.cpu = -(times.user + times.system)  # the transitions only, not the imports or start-up
            for _ in range(int(self.req["pairs"])):
                for action in ("drain", "resume"):
                    samples.append(await self.transition(session, action))
            for t in polls:
                t.cancel()
            await asyncio.gather(*polls, return_exceptions=True)
            times = os.times()
            self.cpu += times.user + times.system
            return samples


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    floor = Floor(req)
    samples = asyncio.run(floor.run())
    Path(sys.argv[2]).write_text(json.dumps({"samples": samples, "cpu": floor.cpu}))


if __name__ == "__main__":
    main()
