"""The TCP rendezvous of a weight-update group, without torch (C-REFIT-GROUP-BLOCK in
docs/sglang-conformance.md).

In SGLang every TP rank calls `init_custom_process_group(init_method="tcp://addr:port", rank=rank_offset +
tp_rank, world_size)` (utils/common.py:1752-1790@0.5.6, 2859-2928@0.5.23): a torch TCPStore client that
connects to the store group rank 0 (the trainer) hosts and waits there until all `world_size` ranks joined.
So `/init_weights_update_group` answers only once the trainer side is up and every rank joined.

Here the store is a plain TCP listener: `Rank0` (the trainer side) accepts `world_size - 1` peers, each
sending one JSON hello line; once all joined it answers every peer `{"ok": true}`. `join` is the SGLang side:
it connects (retrying while refused, as the TCPStore client does) and waits for that answer.

    rank0 = Rank0(0, world_size=2)     # 0: any free port; rank0.port is the one to publish
    threading.Thread(target=rank0.wait, args=(60,)).start()
    ... POST /init_weights_update_group {"master_port": rank0.port, "rank_offset": 1, "world_size": 2} ...
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import socket
import time

PROTOCOL = "rljob-rendezvous/1"
CONNECT_RETRY_S = 0.05


class RendezvousError(Exception):
    pass


class Rank0:
    """Group rank 0: listens on `port` (0 = any free one) from construction on, so peers may connect before
    `wait` runs, as they may with torch's store."""

    def __init__(self, port: int, world_size: int, host: str = "127.0.0.1") -> None:
        if world_size < 2:
            raise ValueError("a weight-update group needs rank 0 and at least one peer")
        self.world_size = world_size
        self._server = socket.create_server((host, port))
        self.port: int = self._server.getsockname()[1]
        self.joined: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()  # cancel() from another thread

    def wait(self, timeout: float) -> list[int]:
        """Block until ranks 1..world_size-1 joined, answer them, and return their ranks (sorted)."""
        deadline = time.monotonic() + timeout
        peers: dict[socket.socket, bytes] = {}
        ready: dict[int, socket.socket] = {}
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while len(ready) < self.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(
                        f"Timed out after {timeout:g} seconds waiting for clients. "
                        f"{len(ready) + 1}/{self.world_size} clients joined."
                    )
                for key, _ in sel.select(left):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_r:
                        raise RendezvousError("rank 0 gave up: cancelled")
                    if sock is self._server:
                        conn, _ = self._server.accept()
                        peers[conn] = b""
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    chunk = sock.recv(4096)
                    if not chunk:  # a peer gave up before the group formed
                        sel.unregister(sock)
                        peers.pop(sock, None)
                        sock.close()
                        continue
                    peers[sock] += chunk
                    if b"\n" in peers[sock]:
                        sel.unregister(sock)
                        rank = self._admit(sock, peers.pop(sock), ready)
                        if rank is not None:
                            ready[rank] = sock
            for sock in ready.values():
                with contextlib.suppress(OSError):
                    sock.sendall(b'{"ok": true}\n')
            self.joined = sorted(ready)
            return self.joined
        finally:
            sel.close()
            for sock in [*peers, *ready.values()]:
                sock.close()
            self.close()

    def _admit(self, sock: socket.socket, line: bytes, ready: dict[int, socket.socket]) -> int | None:
        try:
            hello = json.loads(line.split(b"\n", 1)[0])
            rank, world = int(hello["rank"]), int(hello["world_size"])
        except (ValueError, KeyError, TypeError):
            return _refuse(sock, "not a rendezvous hello")
        if hello.get("protocol") != PROTOCOL:
            return _refuse(sock, f"unknown protocol {hello.get('protocol')!r}")
        if world != self.world_size:
            return _refuse(sock, f"world_size {world} does not match rank 0's {self.world_size}")
        if not 0 < rank < world or rank in ready:
            return _refuse(sock, f"rank {rank} is taken or outside 1..{world - 1}")
        return rank

    def cancel(self) -> None:
        """Make a `wait` in another thread give up now."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def close(self) -> None:
        self._server.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> Rank0:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse(sock: socket.socket, why: str) -> int | None:
    """Tell the peer why it cannot join; None: it did not."""
    with contextlib.suppress(OSError):
        sock.sendall(json.dumps({"ok": False, "error": why}).encode() + b"\n")
    sock.close()
    return None


def serve_rank0(port: int, world_size: int, timeout: float = 1800.0, host: str = "127.0.0.1") -> list[int]:
    """The trainer's half of `init_process_group(rank=0)`: host the store until every peer joined."""
    with Rank0(port, world_size, host) as rank0:
        return rank0.wait(timeout)


async def join(
    address: str, port: int, ranks: list[int], world_size: int, group_name: str, timeout: float
) -> None:
    """SGLang's half, one connection per TP rank; returns once rank 0 answered all of them."""
    for rank in ranks:
        if not 0 < rank < world_size:
            raise RendezvousError(
                f"Invalid rank {rank}: rank should be in the interval [0, {world_size - 1}] "
                "and rank 0 is the trainer"
            )
    deadline = time.monotonic() + timeout
    await asyncio.gather(
        *(_join_one(address, port, rank, world_size, group_name, deadline, timeout) for rank in ranks)
    )


async def _join_one(
    address: str, port: int, rank: int, world_size: int, group_name: str, deadline: float, timeout: float
) -> None:
    opened: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        while opened is None:  # torch's TCPStore client retries a refused connection until its timeout
            try:
                opened = await asyncio.wait_for(
                    asyncio.open_connection(address, port), max(0.01, deadline - time.monotonic())
                )
            except (OSError, TimeoutError):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(
                        f"The client socket has timed out after {int(timeout * 1000)}ms while trying to "
                        f"connect to ({address}, {port})."
                    ) from None
                await asyncio.sleep(min(CONNECT_RETRY_S, left))
        reader, writer = opened
        hello = {"protocol": PROTOCOL, "rank": rank, "world_size": world_size, "group_name": group_name}
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RendezvousError(
                f"Timed out initializing process group in store based barrier on rank {rank} "
                f"(world_size={world_size}, timeout={timeout:g}s)"
            ) from None
        if not line:
            raise RendezvousError(f"rank 0 closed the store connection of rank {rank}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RendezvousError(f"rank 0 refused rank {rank}: {answer.get('error')}")
    finally:
        if opened is not None:
            opened[1].close()
            with contextlib.suppress(OSError):
                await opened[1].wait_closed()
