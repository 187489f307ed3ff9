"""A kubelet mapping for many simulated pods on a small machine: pods share processes, every agent and
every engine emulator (SGLang's, vLLM's) is still a real HTTP server on its pod's loopback IP.

`rljob_mapping()` runs one OS process per container (three per gang pod); 64 pods of those do not fit a
2-core machine. `SharedPods` instead runs

- every pod's agent (`rljob.agent.app.Agent`, configured from the args, env and mounted token file the
  operator put in the pod spec) and engine emulator (`rljob.emulator.server.build_app` for SGLang,
  `rljob.emulator.vllm.server.build_app` for vLLM, configured from the container's launch flags) in ONE
  host process, on one event loop: real aiohttp servers bound to the
  pod's IP and the ports of the pod spec;
- every pod's trainer as a `TrainerDriver` thread in the calling process: the simulated trainer's loop
  (`rljob.testing.trainer`) through the trainer SDK over HTTP, with the pod's URLs passed explicitly;

and gives the kubelet a cheap placeholder process per container, so that it reports the containers
Running and their exits: a placeholder exits with the trainer's exit code when the driver ends, and with
137 for every container when the host process dies. When the kubelet stops a placeholder (the pod is
deleted), the pod's components are stopped too (`attach` the kubelet for that).

    shared = SharedPods(log_path).start()
    kubelet = Kubelet(kubeconfig, [ns], mapping=shared.mapping())
    shared.attach(kubelet)
    kubelet.start()
    ...
    kubelet.stop(); shared.stop()

Limits: an emulator fault that kills its engine (`rljob.emulator.fatal`; vLLM's API server exiting after
its engine core died) kills the whole host, i.e. every pod; containers other than agent/engine/trainer
run as their own processes (`default_mapping`).

Host process: `python -m rljob.testing.shared_pods` reads one JSON request a line on stdin
({"id", "op": "agent"|"sglang"|"vllm"|"stop", "key", "argv", "env"}), answers one JSON line on stdout once the
component listens ({"id", "ok", "error"}), and stops everything at EOF.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import functools
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from rljob import event_loop
from rljob.api.spec import DEFAULT_ENGINE, EngineKind
from rljob.testing import trainer as sim_trainer
from rljob.testing.kubelet import ContainerContext, Kubelet, Launch, Mapping
from rljob.testing.pods import classify
from rljob.trainer import Handoff

log = logging.getLogger("rljob.testing.shared_pods")

EXIT_HOST_DIED = 137  # what a container of a SIGKILLed process reports
# Waits until a trainer driver (or the host's death) writes an exit code into the FIFO, then exits with it.
PLACEHOLDER_SCRIPT = 'read -r code < "$0"; exit "${code:-0}"'


# -- the trainer, as a thread ----------------------------------------------------------------------
@dataclass
class TrainerDriver:
    """The simulated trainer's loop (rollout, checks, lease, checkpoint, publish, refit push) for one pod,
    in a thread. `steps` maps each published version to the seconds from lease granted to publish
    answered (the trainer's own part of the Training phase)."""

    name: str
    argv: Sequence[str]
    agent_url: str
    engine_server_url: str
    weights_dir: Path
    refit_source: str = "disk"
    engine_api_key: str | None = None
    engine: EngineKind = DEFAULT_ENGINE
    on_exit: Callable[[int], None] = lambda _code: None
    steps: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    exit_code: int | None = None
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def start(self) -> TrainerDriver:
        self._thread = threading.Thread(target=self._run, name=f"trainer {self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Asks the loop to end; a driver blocked in a long-poll ends when its agent goes away."""
        self._stopping.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        code = 1
        try:
            code = self._loop()
        except sim_trainer.StaleServing as exc:
            self.error, code = f"STALE SERVING: {exc}", 2
        except Exception as exc:
            if not self._stopping.is_set():
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("trainer %s failed: %s", self.name, self.error)
            code = 0 if self._stopping.is_set() else 1
        finally:
            self.exit_code = code
            self.on_exit(code)

    def _loop(self) -> int:
        args = sim_trainer.parser().parse_args(list(self.argv))
        rollout = sim_trainer.Rollout(self.engine_server_url, self.engine_api_key, args, self.engine)
        sim_trainer.train_loop(
            args,
            Handoff(self.agent_url),
            rollout,
            self.weights_dir,
            self.refit_source,
            stopping=self._stopping.is_set,
            on_step=self.steps.__setitem__,
            log=lambda _event, **_fields: None,  # threads of the calling process: keep its stdout clean
        )
        return 0


# -- the kubelet side ------------------------------------------------------------------------------
@dataclass
class _Component:
    namespace: str
    pod: str
    uid: str
    container: str
    fifo: Path
    in_host: bool
    driver: TrainerDriver | None = None
    seen_running: bool = False


class SharedPods:
    """Owns the host process and the trainer drivers; `mapping()` is what the kubelet calls."""

    def __init__(
        self,
        log_path: Path | str,
        rpc_timeout: float = 30.0,
        reap_period: float = 0.5,
        agent_liveness_seconds: float | None = None,
    ) -> None:
        """`agent_liveness_seconds`: the host's --agent-liveness-seconds (None: the agents' own)."""
        self.log_path = Path(log_path)
        self.agent_liveness_seconds = agent_liveness_seconds
        self.rpc_timeout = rpc_timeout
        self.reap_period = reap_period
        self.proc: subprocess.Popen[bytes] | None = None
        self.errors: list[str] = []  # trainer failures and host death, for the caller to check
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._components: dict[str, _Component] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._kubelet: Kubelet | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> SharedPods:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "rljob.testing.shared_pods", *self._host_args()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, start_new_session=True,
            )  # fmt: skip
        self._spawn(self._read_replies, "shared-pods replies")
        return self

    def _host_args(self) -> list[str]:
        liveness = self.agent_liveness_seconds
        return [] if liveness is None else ["--agent-liveness-seconds", str(liveness)]

    def attach(self, kubelet: Kubelet) -> None:
        """Lets components follow their placeholders: a stopped container stops its component."""
        self._kubelet = kubelet
        self._spawn(self._reap_loop, "shared-pods reaper")

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        with self._lock:
            drivers = [c.driver for c in self._components.values() if c.driver is not None]
        for d in drivers:
            d.stop()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()  # EOF: the host stops every component and exits
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        deadline = time.monotonic() + timeout  # drivers end once their agents are gone
        for d in drivers:
            d.join(timeout=max(0.0, deadline - time.monotonic()))
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> SharedPods:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def drivers(self) -> list[TrainerDriver]:
        with self._lock:
            return [c.driver for c in self._components.values() if c.driver is not None]

    # -- the mapping -------------------------------------------------------------------------------
    def mapping(self, extra_sglang_args: Sequence[str] = ()) -> Mapping:
        def mapping(ctx: ContainerContext) -> Launch:
            c = classify(ctx, extra_sglang_args)
            if c.kind == "other":  # its own process, as rljob_mapping does
                return Launch(c.args, env=c.env)
            return self._start(ctx, c.kind, c.args, c.env)

        return mapping

    def _start(self, ctx: ContainerContext, kind: str, argv: list[str], env: dict[str, str]) -> Launch:
        meta = ctx.pod["metadata"]
        key = f"{meta['uid']}/{ctx.name}"
        self._stop_component(key)  # a restarted container replaces its component
        fifo = ctx.scratch / "shared" / ctx.name
        fifo.parent.mkdir(parents=True, exist_ok=True)
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
        comp = _Component(
            meta["namespace"], meta["name"], meta["uid"], ctx.name, fifo, in_host=kind != "trainer"
        )
        if kind == "trainer":
            comp.driver = TrainerDriver(
                name=f"{comp.namespace}/{comp.pod}",
                argv=argv,
                agent_url=env.get("RLJOB_AGENT_URL", f"http://{ctx.pod_ip}:8472"),
                engine_server_url=env.get("RLJOB_ENGINE_SERVER_URL", f"http://{ctx.pod_ip}:30000"),
                # One directory per pod: trainers of a gang share the claim, and each writes its own file.
                weights_dir=Path(env.get("RLJOB_WEIGHTS_DIR", str(ctx.scratch / "weights")))
                / f"pod-{env.get('RLJOB_POD_INDEX', comp.pod)}",
                refit_source=env.get("RLJOB_REFIT_SOURCE", "disk"),
                engine_api_key=env.get("RLJOB_ENGINE_API_KEY"),
                engine=EngineKind(env.get("RLJOB_ENGINE", DEFAULT_ENGINE.value)),
                on_exit=functools.partial(self._trainer_exited, comp),
            )
        else:
            reply = self._call({"op": kind, "key": key, "argv": argv, "env": env})
            if not reply.get("ok"):
                raise RuntimeError(f"shared host cannot start {kind} of {comp.pod}: {reply.get('error')}")
        with self._lock:
            self._components[key] = comp
        if comp.driver is not None:
            comp.driver.start()
        return Launch(["sh", "-c", PLACEHOLDER_SCRIPT, str(fifo)], env=env)

    def _trainer_exited(self, comp: _Component, code: int) -> None:
        driver = comp.driver
        if driver is not None and driver.error:
            self.errors.append(f"trainer {driver.name}: {driver.error}")
        with self._lock:
            ended_by_itself = self._components.get(f"{comp.uid}/{comp.container}") is comp
        if ended_by_itself and not self._stopping.is_set():  # else its placeholder is already stopped
            _write_exit(comp.fifo, code)

    # -- stopping components -----------------------------------------------------------------------
    def _stop_component(self, key: str) -> None:
        with self._lock:
            comp = self._components.pop(key, None)
        if comp is None:
            return
        if comp.driver is not None:
            comp.driver.stop()
        elif self.alive and not self._stopping.is_set():
            with contextlib.suppress(RuntimeError, TimeoutError, OSError):
                self._call({"op": "stop", "key": key})

    def _reap_loop(self) -> None:
        while not self._stopping.wait(self.reap_period):
            kubelet = self._kubelet
            if kubelet is None:
                continue
            with self._lock:
                comps = list(self._components.items())
            for key, comp in comps:
                runner = kubelet.runner(comp.namespace, comp.pod, comp.uid)  # None: that pod is gone
                if runner is not None and comp.container in runner.processes():
                    comp.seen_running = True
                elif comp.seen_running or runner is None:
                    self._stop_component(key)

    # -- RPC to the host ---------------------------------------------------------------------------
    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError("the shared host process is not running")
        rid = next(self._ids)
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            self._pending[rid] = fut
        line = json.dumps({**request, "id": rid}).encode() + b"\n"
        try:
            with self._write_lock:
                assert proc.stdin is not None
                proc.stdin.write(line)
                proc.stdin.flush()
            return fut.result(self.rpc_timeout)
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def _read_replies(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                reply = json.loads(raw)
            except ValueError:
                continue
            with self._lock:
                fut = self._pending.get(int(reply.get("id", 0)))
            if fut is not None and not fut.done():
                fut.set_result(reply)
        # EOF: the host is gone. Every in-host container "exits" as its process would: killed.
        with self._lock:
            pending = list(self._pending.values())
            host_comps = [c for c in self._components.values() if c.in_host]
        for fut in pending:
            if not fut.done():
                fut.set_result({"ok": False, "error": "the shared host process exited"})
        if not self._stopping.is_set():
            self.errors.append(
                f"the shared host process exited (code {self.proc.wait()}); see {self.log_path}"
            )
            for comp in host_comps:
                _write_exit(comp.fifo, EXIT_HOST_DIED)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)


def _write_exit(fifo: Path, code: int, timeout: float = 5.0) -> None:
    """Hands `code` to the container's placeholder (non-blocking: a placeholder already gone is fine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet (the placeholder is starting)
                return
            time.sleep(0.05)
            continue
        with contextlib.suppress(OSError):
            os.write(fd, f"{code}\n".encode())
        os.close(fd)
        return


# -- the host process ------------------------------------------------------------------------------
@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """The container's env while its config is parsed (flags default from env). One loop thread: safe."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Host:
    def __init__(self, out: IO[str], agent_liveness_s: float | None = None) -> None:
        self.out = out
        self.agent_liveness_s = agent_liveness_s
        self.stoppers: dict[str, Callable[[], Awaitable[None]]] = {}
        self.tasks: set[asyncio.Future[None]] = set()

    def background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def reply(self, rid: int, error: str | None = None) -> None:
        self.out.write(json.dumps({"id": rid, "ok": error is None, "error": error}) + "\n")
        self.out.flush()

    async def handle(self, req: dict[str, Any]) -> None:
        rid, op, key = int(req["id"]), str(req["op"]), str(req.get("key", ""))
        try:
            if op == "stop":  # in the background: a listener closes at once, open long-polls take longer
                stopper = self.stoppers.pop(key, None)
                if stopper is not None:
                    self.background(stopper())
            elif op == "agent":
                await self.stop(key)
                self.stoppers[key] = await self.start_agent(req["argv"], req.get("env") or {})
            elif op == "sglang":
                await self.stop(key)
                self.stoppers[key] = await self.start_sglang(req["argv"], req.get("env") or {})
            elif op == "vllm":
                await self.stop(key)
                self.stoppers[key] = await self.start_vllm(req["argv"], req.get("env") or {})
            else:
                raise ValueError(f"unknown op {op!r}")
        except (Exception, SystemExit) as exc:  # argparse errors are SystemExit
            log.exception("%s %s failed", op, key)
            self.reply(rid, f"{type(exc).__name__}: {exc}")
            return
        self.reply(rid)

    async def stop(self, key: str) -> None:
        stopper = self.stoppers.pop(key, None)
        if stopper is not None:
            await stopper()

    async def start_agent(self, argv: list[str], env: dict[str, str]) -> Callable[[], Awaitable[None]]:
        from rljob.agent.app import Agent
        from rljob.agent.config import parse_config

        with _environ(env):
            cfg = parse_config(argv)
        if self.agent_liveness_s is not None:
            cfg = dataclasses.replace(cfg, liveness_s=max(cfg.liveness_s, self.agent_liveness_s))
        agent = Agent(cfg)
        await agent.start()
        return agent.stop

    async def start_sglang(self, argv: list[str], env: dict[str, str]) -> Callable[[], Awaitable[None]]:
        from rljob.emulator.config import parse_config
        from rljob.emulator.server import build_app

        with _environ(env):
            cfg = parse_config(argv)
        return await self.serve_app(build_app(cfg), cfg.host, cfg.port, cfg.startup_seconds)

    async def start_vllm(self, argv: list[str], env: dict[str, str]) -> Callable[[], Awaitable[None]]:
        from rljob.emulator.vllm.config import parse_config
        from rljob.emulator.vllm.server import build_app

        with _environ(env):  # vLLM reads its VLLM_* variables as it parses its launch
            cfg = parse_config(argv)
        return await self.serve_app(build_app(cfg), cfg.host, cfg.port, cfg.startup_seconds)

    async def serve_app(
        self, app: web.Application, host: str | None, port: int, startup_seconds: float
    ) -> Callable[[], Awaitable[None]]:
        """An emulator's app on its pod's address once its startup delay passed; returns its stopper."""
        # Hung handlers (faults) must not hold a stop for aiohttp's default 60 s, as in server.main.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)

        async def listen() -> None:
            await asyncio.sleep(startup_seconds)  # model loading: the port is not open yet
            await runner.setup()
            await web.TCPSite(runner, host, port).start()

        if startup_seconds > 0:
            task = asyncio.get_running_loop().create_task(listen())

            async def stop_later() -> None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await runner.cleanup()

            return stop_later
        await listen()
        return runner.cleanup

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=16 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            self.background(self.handle(json.loads(line)))
        stops = [stopper() for stopper in self.stoppers.values()]
        self.stoppers.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), 5.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rljob.testing.shared_pods", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--agent-liveness-seconds", type=float, default=None,
        help="check SGLang's liveness at least this far apart in every agent (--engine-liveness-seconds): "
        "hundreds of agents on one core otherwise spend a fifth of it pinging their emulators",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # As the agent and the emulator log as processes (INFO; no access log).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    out = sys.stdout
    sys.stdout = sys.stderr  # stdout carries replies only; stray prints go to the log
    event_loop.run(_Host(out, args.agent_liveness_seconds).serve())  # the agents' loop (agent/main.py)


if __name__ == "__main__":
    main()
