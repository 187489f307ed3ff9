"""SGLang instances that span pods: `--nnodes N --node-rank R --dist-init-addr HOST:PORT` (C-NODE and
C-TP-REPLY in docs/sglang-conformance.md).

In SGLang every node runs schedulers for its share of the TP ranks, and they meet at `--dist-init-addr`
(torch.distributed's TCP store on node 0). Only node rank 0 runs the tokenizer and the HTTP server
(…/entrypoints/engine.py:868-890@0.5.6, engine.py:1281@0.5.23); the others run
`launch_dummy_health_check_server`, which answers `/ping`, `/health` and `/health_generate` with 200 and
nothing else (utils/common.py:3635-3647@0.5.23, utils/common.py:2438-2450@0.5.6). A control request reaches
every rank through the TP-group broadcast from rank 0 (scheduler.py:615-625,1141-1161@0.5.6), and its reply
means rank 0 finished.

Here: node 0 listens at HOST:PORT (the address HOST resolves to, as the store binds the pod's address) and
opens its HTTP port only once the other `N - 1` nodes joined, as SGLang's launch blocks in
init_process_group. Its release and resume reach each follower over that TCP connection (one JSON line
each way); each follower frees or maps its own GPUs' regions and answers. A follower that stops answering
breaks the instance (node 0 dies, as a TP collective with a dead rank does), and followers exit when node 0
is gone. A follower holds real emulated memory (`--gpus` per pod) and serves the dummy server's three routes
plus `/_emulator/memory`, `/_emulator/faults` and `/_emulator/stats` (the test world's GPU probe and fault
injection). `--fault-release-ignore` on a follower: its ranks acknowledge a release without freeing (what
release verification on that pod must catch). Not modelled: refits on the followers (their weights region
only follows release and resume), TP collectives during generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import Counter
from typing import Any

from aiohttp import web

from rljob.emulator import fatal
from rljob.emulator.config import EmulatorConfig, startup_error
from rljob.emulator.faults import Faults
from rljob.emulator.memory import REGIONS, RegionBackend, make_backend
from rljob.emulator.routes_emulator import update_faults

log = logging.getLogger("sglang.emulator")

PROTOCOL = "rljob-emulator-nodes/1"
JOIN_RETRY_S = 0.1


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise fatal.StartupError(f"--dist-init-addr must be HOST:PORT, not {addr!r}")
    return host.strip("[]"), int(port)


def effective(cfg: EmulatorConfig, tag: str) -> bool:
    """Does pausing this tag unmap anything? (Engine._effective: the memory saver, and its env for graphs.)"""
    if not cfg.enable_memory_saver:
        return False
    return tag != "cuda_graph" or cfg.cuda_graph_in_memory_saver


# --- node 0 -----------------------------------------------------------------------------------------


class _Peer:
    def __init__(self, node_rank: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.node_rank = node_rank
        self.reader = reader
        self.writer = writer
        self.replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.watch: asyncio.Task[None] | None = None


class NodeLink:
    """Node 0's side: the listener at --dist-init-addr and one connection per follower node."""

    def __init__(self, cfg: EmulatorConfig, join_timeout_s: float = 600.0) -> None:
        self.cfg = cfg
        self.host, self.port = split_addr(cfg.dist_init_addr or "")
        self.join_timeout_s = join_timeout_s
        self.peers: dict[int, _Peer] = {}
        self._joined = asyncio.Event()
        self._lock = asyncio.Lock()
        self._server: asyncio.Server | None = None

    async def start(self, app: web.Application | None = None) -> None:
        """Listen, then wait until every follower node joined (the HTTP port opens only after)."""
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        log.info(
            "node 0 of %d: waiting at %s:%d for the other nodes to join",
            self.cfg.nnodes,
            self.host,
            self.port,
        )
        try:
            await asyncio.wait_for(self._joined.wait(), self.join_timeout_s)
        except TimeoutError:
            raise fatal.StartupError(
                f"init_process_group timed out after {self.join_timeout_s:g}s: "
                f"{len(self.peers) + 1}/{self.cfg.nnodes} nodes joined"
            ) from None
        log.info("all %d nodes joined", self.cfg.nnodes)

    async def stop(self, app: web.Application | None = None) -> None:
        if self._server is not None:
            self._server.close()
        for peer in self.peers.values():
            if peer.watch is not None:
                peer.watch.cancel()
            peer.writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = json.loads(await reader.readline() or b"{}")
        except ValueError:
            hello = {}
        rank = hello.get("node_rank")
        if hello.get("protocol") != PROTOCOL or not isinstance(rank, int) or not 0 < rank < self.cfg.nnodes:
            log.warning("refusing a node that sent %r", hello)
            writer.close()
            return
        if rank in self.peers or self._joined.is_set():
            log.warning("refusing a second node rank %d", rank)
            refusal = {"ok": False, "error": f"node rank {rank} already joined"}
            writer.write(json.dumps(refusal).encode() + b"\n")
            writer.close()
            return
        peer = _Peer(rank, reader, writer)
        self.peers[rank] = peer
        writer.write(json.dumps({"ok": True, "nnodes": self.cfg.nnodes}).encode() + b"\n")
        await writer.drain()
        peer.watch = asyncio.ensure_future(self._read(peer))
        log.info("node rank %d joined (%d GPU(s))", rank, int(hello.get("gpus") or 0))
        if len(self.peers) == self.cfg.nnodes - 1:
            self._joined.set()

    async def _read(self, peer: _Peer) -> None:
        """Every line from a follower is a reply; its connection closing means its ranks are gone."""
        while True:
            line = await peer.reader.readline()
            if not line:
                # A TP collective with a dead rank never completes; SGLang's ranks die with it.
                fatal.scheduler_exception(
                    "RuntimeError",
                    f"[TP group] the ranks on node {peer.node_rank} are gone (connection closed): "
                    "the instance cannot run without them",
                )
            with contextlib.suppress(ValueError):
                await peer.replies.put(json.loads(line))

    async def broadcast(self, op: str, **fields: Any) -> dict[int, dict[str, Any]]:
        """One control message to every follower node; returns each one's reply once all answered."""
        async with self._lock:
            message = json.dumps({"op": op, **fields}).encode() + b"\n"
            for peer in self.peers.values():
                peer.writer.write(message)
                await peer.writer.drain()
            return {rank: await peer.replies.get() for rank, peer in sorted(self.peers.items())}


# --- a follower node --------------------------------------------------------------------------------


class FollowerNode:
    """Node rank > 0: its schedulers' memory on its own GPUs, driven by node 0's control messages."""

    def __init__(self, cfg: EmulatorConfig, backend: RegionBackend | None = None) -> None:
        self.cfg = cfg
        self.faults: Faults = cfg.faults
        self.backend = backend or make_backend(cfg)
        self.offload_tags: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.received: Counter[str] = Counter()  # control messages from node 0, by op
        self.joined_at: float | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._serving: asyncio.Task[None] | None = None

    async def join(self, timeout_s: float = 600.0) -> None:
        """Connect to node 0, retrying while its name does not resolve or nothing listens yet (as the
        TCPStore client does), and say which node rank this is."""
        host, port = split_addr(self.cfg.dist_init_addr or "")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                break
            except OSError as e:  # refused, unreachable, or the name does not resolve yet
                if time.monotonic() >= deadline:
                    raise fatal.StartupError(
                        f"cannot reach node 0 at {host}:{port} within {timeout_s:g}s: {e}"
                    ) from e
                await asyncio.sleep(JOIN_RETRY_S)
        hello = {"protocol": PROTOCOL, "node_rank": self.cfg.node_rank, "gpus": self.backend.gpus}
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        answer = json.loads(await reader.readline() or b"{}")
        if not answer.get("ok"):
            raise fatal.StartupError(f"node 0 refused node rank {self.cfg.node_rank}: {answer.get('error')}")
        self._reader, self._writer = reader, writer
        self.joined_at = time.time()
        log.info("node rank %d joined node 0 at %s:%d", self.cfg.node_rank, host, port)

    async def start(self, app: web.Application | None = None) -> None:
        await self.join()
        self._serving = asyncio.ensure_future(self.serve())

    async def stop(self, app: web.Application | None = None) -> None:
        if self._serving is not None:
            self._serving.cancel()
        if self._writer is not None:
            self._writer.close()

    async def serve(self) -> None:
        assert self._reader is not None and self._writer is not None
        while True:
            line = await self._reader.readline()
            if not line:
                # Node 0 is gone: its ShutdownReq or its death ends every rank (engine.py:1260-1270@0.5.23).
                log.error("node 0 is gone: the ranks of node %d exit", self.cfg.node_rank)
                fatal._flush()
                os._exit(1)
            reply = self.apply(json.loads(line))
            self._writer.write(json.dumps(reply).encode() + b"\n")
            await self._writer.drain()

    def apply(self, message: dict[str, Any]) -> dict[str, Any]:
        op, tags = str(message.get("op")), [str(t) for t in message.get("tags") or REGIONS]
        self.received[op] += 1
        if op == "release":
            if self.faults.release_ignore:
                log.warning(
                    "fault: node %d acknowledges release(%s), frees nothing", self.cfg.node_rank, tags
                )
                return {"ok": True}
            self.offload_tags.update(tags)
            for tag in dict.fromkeys(tags):
                if not effective(self.cfg, tag):
                    continue
                if self.backend.is_paused(tag):  # torch_memory_saver's exit(1) on this node's ranks
                    fatal.memory_saver_message("Cannot pause allocation that is not active.")
                    fatal.scheduler_exception(
                        "RuntimeError", f"on node {self.cfg.node_rank}: {tag} paused twice"
                    )
                self.backend.pause(tag, unmap_delay_s=self.faults.release_unmap_delay_s)
        elif op == "resume":
            for tag in tags:
                self.offload_tags.discard(tag)
                if effective(self.cfg, tag) and self.backend.is_paused(tag):
                    self.backend.resume(tag)
        return {"ok": True}


def memory_report(backend: RegionBackend) -> dict[str, Any]:
    return {
        "gpus": [
            {
                "index": g,
                "used_bytes": backend.used_bytes(g),
                "total_bytes": backend.total_bytes(g),
                "regions": backend.region_bytes(g),
            }
            for g in range(backend.gpus)
        ]
    }


FOLLOWER_KEY = web.AppKey("follower", FollowerNode)


def build_follower_app(cfg: EmulatorConfig) -> web.Application:
    """The dummy health server of a node rank > 0, plus the emulator's debug routes."""
    error = startup_error(cfg)
    if error is not None:
        raise fatal.StartupError(f"Scheduler hit an exception while starting: {error}")
    node = FollowerNode(cfg)

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        node.calls[request.path] += 1
        return await handler(request)

    app = web.Application(middlewares=[count])
    app[FOLLOWER_KEY] = node

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def memory(request: web.Request) -> web.Response:
        return web.json_response(memory_report(node.backend))

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": cfg.profile.version,
                "nnodes": cfg.nnodes,
                "node_rank": cfg.node_rank,
                "calls": dict(node.calls),
                "received": dict(node.received),
                "offload_tags": sorted(node.offload_tags),
                "memory": memory_report(node.backend),
            }
        )

    async def get_faults(request: web.Request) -> web.Response:
        return web.json_response(node.faults.as_dict())

    async def set_faults(request: web.Request) -> web.Response:
        return await update_faults(request, node.faults)

    for path in ("/ping", "/health", "/health_generate"):
        app.router.add_get(path, ok)
    app.router.add_get("/_emulator/memory", memory)
    app.router.add_get("/_emulator/stats", stats)
    app.router.add_get("/_emulator/faults", get_faults)
    app.router.add_post("/_emulator/faults", set_faults)
    app.on_startup.append(node.start)
    app.on_cleanup.append(node.stop)
    return app
