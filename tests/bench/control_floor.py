"""The floor of one lock-step transition, measured on the benchmark's own agents (run by
bench_control_overhead.py after a job succeeded and its operator stopped, as a process of its own):

    python tests/bench/control_floor.py REQUEST.json RESULT.json

A transition is the least any operator must do: send one small command (drain, then resume, epochs
counting on from the job's) to every agent at once, take each agent's report of the finished command
over a connection already open (JSON parsed, nothing validated), and write one status merge-patch
(over aiohttp with the kubeconfig's credentials, as the operator does: kubeclient/apiserver.py
ApiServer) once the last report came: to an RLJob that carries the
benchmark job's final status, and of what a phase change of the operator changes (phase, epoch,
phaseStartTime, reason, message, and the timeline, conditions and pods lists, which a merge patch
replaces whole). Its floor is that wall time minus the slowest agent's own time for the command
(`lastCommand.seconds`), as the operator's overhead is the phase's wall time minus `agentSeconds`.

Two ways to send the commands, `pairs` drain/resume pairs each, the reports always as frames of the
agent's WebSocket (`GET /v1/channel`), its one report transport:
- `post`: a POST /v1/commands per agent (what the operator does while a channel is not open);
- `channel`: a command frame per agent on the channel and its reply: what the operator does
  (controller/agent_client.py).

REQUEST: {"agents": [[ip, port], ...], "token": str, "epoch": int (the job's last), "pairs": int,
"kubeconfig": path, "namespace": str, "name": str (an RLJob no operator watches: its status is patched),
"status": the job's final status (the floor RLJob already carries it)}.
RESULT: {"samples": [{"channel", "action", "wall", "in_agent", "patch"}], "cpu": {channel: seconds of
this process over that channel's transitions}}.
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

from rljob import event_loop
from rljob.api.crd import GROUP, PLURAL, VERSION
from rljob.kubeclient.apiserver import MERGE_PATCH, ApiServer
from rljob.kubeclient.credentials import Credentials


class Floor:
    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.urls = [f"http://{ip}:{port}" for ip, port in req["agents"]]
        self.headers = {"Authorization": f"Bearer {req['token']}"}
        self.latest: list[dict[str, Any] | None] = [None] * len(self.urls)
        self.pending: set[int] = set()
        self.epoch = 0
        self.cpu: dict[str, float] = {}
        self.done = asyncio.Event()
        self.channels: list[aiohttp.ClientWebSocketResponse | None] = [None] * len(self.urls)
        self.unanswered = 0  # channel: command frames sent and not answered yet
        self.answered = asyncio.Event()
        self.refused: str | None = None
        self.kube = ApiServer(Credentials.from_kubeconfig(req["kubeconfig"]))

    def _finished(self, state: dict[str, Any]) -> bool:
        cmd = state.get("lastCommand") or {}
        return bool(cmd.get("epoch") == self.epoch and cmd.get("state") != "Running")

    async def follow_channel(self, session: aiohttp.ClientSession, i: int) -> None:
        while True:  # a connection refused or timed out on a busy host is made again, as the operator does
            try:
                async with session.ws_connect(f"{self.urls[i]}/v1/channel", headers=self.headers) as ws:
                    self.channels[i] = ws
                    async for msg in ws:
                        frame = json.loads(msg.data)
                        if "state" in frame:
                            self._reported(i, frame["state"])
                        else:
                            self._replied(frame["reply"])
            except (TimeoutError, aiohttp.ClientError) as err:
                print(f"floor: channel {self.urls[i]}: {err!r}", file=sys.stderr)
            await asyncio.sleep(0.2)

    def _replied(self, reply: dict[str, Any]) -> None:
        if reply.get("status") not in (200, 202):
            self.refused = f"{reply.get('action')} {reply.get('epoch')}: {reply}"
        self.unanswered -= 1
        if self.unanswered == 0:
            self.answered.set()

    def _reported(self, i: int, state: dict[str, Any]) -> None:
        self.latest[i] = state
        if i in self.pending and self._finished(state):
            self.pending.discard(i)
            if not self.pending:
                self.done.set()

    async def transition(self, session: aiohttp.ClientSession, channel: str, action: str) -> dict[str, Any]:
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

        if channel == "post":
            await asyncio.gather(*(send(u) for u in self.urls))
        else:
            self.unanswered, self.refused = len(self.urls), None
            self.answered.clear()
            frame = json.dumps(body)
            for ws in self.channels:
                assert ws is not None
                await ws.send_str(frame)
            await asyncio.wait_for(self.answered.wait(), 120)
            if self.refused:
                raise RuntimeError(f"refused: {self.refused}")
        await asyncio.wait_for(self.done.wait(), 120)
        reported = time.perf_counter()
        patch = {"status": self._phase_change(action)}
        ns, name = self.req["namespace"], self.req["name"]
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}/status"
        await self.kube.call("patch_status", "PATCH", path, patch, content_type=MERGE_PATCH)
        ended = time.perf_counter()
        in_agent = max((s or {}).get("lastCommand", {}).get("seconds") or 0.0 for s in self.latest)
        wall, patched = ended - began, ended - reported
        return {"channel": channel, "action": action, "wall": wall, "in_agent": in_agent, "patch": patched}

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
        timeout = aiohttp.ClientTimeout(total=None, connect=5)
        samples = []
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.epoch = int(self.req["epoch"])
            for channel in ("post", "channel"):
                self.latest = [None] * len(self.urls)
                follows = [
                    asyncio.create_task(self.follow_channel(session, i)) for i in range(len(self.urls))
                ]
                while any(s is None for s in self.latest):  # every connection open before the first command
                    await asyncio.sleep(0.05)
                times = os.times()
                cpu = -(times.user + times.system)  # the transitions only, not the imports or start-up
                for _ in range(int(self.req["pairs"])):
                    for action in ("drain", "resume"):
                        samples.append(await self.transition(session, channel, action))
                times = os.times()
                self.cpu[channel] = cpu + times.user + times.system
                for t in follows:
                    t.cancel()
                await asyncio.gather(*follows, return_exceptions=True)
        return samples


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    floor = Floor(req)

    async def measure() -> list[dict[str, Any]]:
        try:
            return await floor.run()
        finally:
            await floor.kube.close()

    samples = event_loop.run(measure())  # the operator's loop: uvloop where it is installed
    Path(sys.argv[2]).write_text(json.dumps({"samples": samples, "cpu": floor.cpu}))


if __name__ == "__main__":
    main()
