"""Wiring of the agent: the engine (built through the registry), the state store, the desks, the
listeners, background loops.
With `--state-dir` the store keeps a pod-local record, and a restarted agent recovers from it
(agent/record.py, agent/recovery.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from rljob.agent import follower
from rljob.agent.actions import Actions
from rljob.agent.commands import CommandDesk
from rljob.agent.config import AgentConfig
from rljob.agent.engines import EngineLink, build_engine
from rljob.agent.gpu_probe import make_probe
from rljob.agent.lease import LeaseDesk
from rljob.agent.metrics import AgentMetrics
from rljob.agent.operations import Operations
from rljob.agent.operator_api import build_operator_app
from rljob.agent.record import AgentRecord, RecordError
from rljob.agent.recovery import Recovery
from rljob.agent.refit_window import RefitWindows
from rljob.agent.rollout import RolloutSampler
from rljob.agent.state import StateStore
from rljob.agent.trainer_api import build_trainer_app
from rljob.agent.watch import EngineWatch

log = logging.getLogger("rljob.agent")


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.metrics = AgentMetrics()
        self.record = AgentRecord(cfg.state_dir) if cfg.state_dir else None
        self.store = StateStore(on_commit=self.metrics.revision.set, record=self.record)
        link = EngineLink(
            cfg.engine_server_url,
            api_key=cfg.engine_api_key,
            admin_api_key=cfg.engine_admin_api_key,
            call_timeout_s=cfg.call_timeout_s,
            observe=self.metrics.observe_engine,
            hang_probe_timeout_s=cfg.scheduler_probe_timeout_s,
            refit_source=cfg.refit_source,
            keep_released_weights=cfg.keep_released_weights,
        )
        self.engine = build_engine(cfg.engine, link)
        self.windows = RefitWindows(self.store, self.engine, cfg.group_init_timeout_s)
        self.lease = LeaseDesk(self.store)
        self.watch = EngineWatch(self.store, self.engine, interval_s=cfg.liveness_s)
        probe = make_probe(cfg.gpu_probe, self.engine)
        self.sampler = RolloutSampler(
            self.store, self.engine, cfg.rollout_sample_s, cfg.rollout_report_s, probe=probe
        )
        ops = Operations(
            self.store,
            self.engine,
            probe,
            self.windows,
            self.lease,
            self.metrics,
            cfg.call_timeout_s,
            before_drain=self.sampler.final_sample,
            before_serving=self.sampler.begin,
        )
        self.store.state.node_rank = cfg.node_rank
        actions = Actions.leader(ops)
        if cfg.node_rank > 0:  # a follower pod: no engine API, its own GPUs only (agent/follower.py)
            self.watch = follower.FollowerWatch(self.store, self.engine)  # type: ignore[assignment]
            ops = follower.FollowerOperations(
                self.store, self.engine, ops.probe, self.windows, self.lease, self.metrics, cfg.call_timeout_s
            )
            actions = Actions.follower(ops)
        self.desk = CommandDesk(self.store, actions, self.metrics, self.watch.confirm_death, self.engine.name)
        self.recovery = Recovery(self.store, self.engine, ops.probe, self._continue_recorded)
        self.watch.on_recover = self.recovery.run
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Listen on both APIs and start the background loops; no signal handling, so that the agent can
        be embedded in another program's event loop (`run` is the `rljob-agent` process: start, wait for
        SIGTERM/SIGINT, stop)."""
        self._load_record()
        await self.engine.start()
        for app, (host, port) in (
            (
                build_operator_app(self.store, self.desk, self.metrics, self.cfg.token, self.engine.liveness),
                self.cfg.listen,
            ),
            (build_trainer_app(self.store, self.lease, self.windows, self.metrics), self.cfg.trainer_listen),
            *self._engine_app(),
        ):
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            self._runners.append(runner)
        log.info(
            "rljob-agent listening: operator %s:%d, trainer %s:%d; %s %s; GPU probe %s",
            *self.cfg.listen,
            *self.cfg.trainer_listen,
            self.engine.name,
            self.cfg.engine_server_url,
            self.cfg.gpu_probe,
        )
        self._tasks = [
            asyncio.create_task(self.watch.run(), name="engine-watch"),
            *(
                [asyncio.create_task(self.sampler.run(), name="rollout-sampler")]
                if self.cfg.node_rank == 0  # a follower's engine serves no load
                else []
            ),
        ]

    def _engine_app(self) -> list[tuple[web.Application, tuple[str, int]]]:
        """The engine's framework endpoint, where asked for and on a leader (a follower has no engine API)."""
        if self.cfg.engine_listen is None or self.cfg.node_rank > 0:
            return []
        app = self.engine.framework_endpoint(self.store, self.lease, self.windows, self.cfg.refit_source)
        return [(app, self.cfg.engine_listen)]

    def _load_record(self) -> None:
        """The first start in a pod writes the record; a restart restores it (Recovering until the watch
        has checked it against the engine). An unreadable record: what the last process did is unknown."""
        if self.record is None:
            return
        try:
            data = self.record.load()
        except RecordError as e:
            self.store.unsure(f"the agent restarted and its record is unreadable: {e}")
            return
        if data is not None and self.cfg.node_rank > 0:
            # A follower (agent/follower.py) keeps its verification samples in memory only: not recovered.
            self.store.boots = int(data.get("boots") or 1) + 1
            self.store.unsure("a follower pod's agent restarted; followers do not recover their state")
            return
        if data is not None:
            self.store.restore(data)
            log.warning(
                "rljob-agent restarted (%d earlier start(s) in this pod): recovering stage %s, epoch %d",
                self.store.boots - 1,
                self.store.state.stage.value,
                self.store.state.epoch,
            )
        self.store.commit()

    def _continue_recorded(self) -> None:
        if self.store.command is not None:
            self.desk.resume_recorded(self.store.command)

    async def stop(self) -> None:
        """Stops what `start` started (background loops, listeners, the engine's client)."""
        log.info("rljob-agent stopping")
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()
        await self.engine.close()

    async def run(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await self.stop()
