"""The simulated trainer's world: one collective per training step over every trainer process of the gang,
formed only from the env the operator injects (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), as
torch.distributed's env:// init reads it.

Each step every rank all-reduces a one-hot vector of length WORLD_SIZE (a 1 at its RANK): the result is all
ones exactly when every rank of 0..WORLD_SIZE-1 took part once and all agree on the world's size, so a
wrong rank or world size fails the step (`WorldError`), or its rendezvous.

- `torch`: torch.distributed with gloo on CPU (`init_process_group(backend="gloo", init_method="env://")`).
- `tcp`: the same contract without torch, for machines where torch is not installed: rank 0 hosts a plain
  TCP rendezvous at MASTER_ADDR:MASTER_PORT, refuses a second rank of the same number or another world
  size, sums the vectors and answers every rank.
- `auto`: torch if importable, else tcp; with RLJOB_REQUIRE_TORCH=1 (set by .ci/run), torch or an error.

Each step's record names the backend (`torch` or `tcp`) and, for torch, the process group's own backend as
torch.distributed reports it (`group_backend`: "gloo"), so a test can tell which collective ran.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

BACKENDS = ("auto", "torch", "tcp")
CONNECT_RETRY_S = 0.1


class WorldError(Exception):
    """The trainer world is not the one the env describes."""


def torch_available() -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_gloo_available())
    except ImportError:
        return False


def world_env(env: Mapping[str, str]) -> tuple[str, int, int, int]:
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if not env.get(k)]
    if missing:
        raise WorldError(f"the trainer world needs {', '.join(missing)} (the operator injects them)")
    size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    if not 0 <= rank < size:
        raise WorldError(f"RANK {rank} is outside a world of {size}")
    return env["MASTER_ADDR"], int(env["MASTER_PORT"]), size, rank


class World:
    def __init__(self, backend: str, size: int, rank: int) -> None:
        self.backend, self.size, self.rank = backend, size, rank
        self.group_backend: str | None = None  # torch.distributed's own name of the group's backend
        self.steps = 0

    def all_reduce(self, vector: list[float]) -> list[float]:
        raise NotImplementedError

    def step(self) -> dict[str, Any]:
        """One collective, checked: every rank present exactly once, in a world of the same size."""
        one_hot = [1.0 if i == self.rank else 0.0 for i in range(self.size)]
        started = time.perf_counter()
        total = self.all_reduce(one_hot)
        self.steps += 1
        if total != [1.0] * self.size:
            raise WorldError(
                f"all_reduce of one-hot rank vectors gave {total}, not {self.size} ones: a rank is missing, "
                f"repeated, or a process disagrees on WORLD_SIZE"
            )
        record: dict[str, Any] = {
            "backend": self.backend,
            "world_size": self.size,
            "rank": self.rank,
            "step": self.steps,
            "seconds": round(time.perf_counter() - started, 6),
        }
        if self.group_backend is not None:
            record["group_backend"] = self.group_backend
        return record

    def close(self) -> None:
        pass


class TorchWorld(World):
    def __init__(self, size: int, rank: int, timeout_s: float) -> None:
        import torch.distributed as dist

        super().__init__("torch", size, rank)
        dist.init_process_group(backend="gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
        if (dist.get_world_size(), dist.get_rank()) != (size, rank):
            raise WorldError(
                f"torch formed world {dist.get_world_size()}/{dist.get_rank()}, not {size}/{rank}"
            )
        self.group_backend = str(dist.get_backend())

    def all_reduce(self, vector: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(vector, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(x) for x in tensor.tolist()]

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _send(sock: socket.socket, obj: Any) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv(f: Any) -> Any:
    line = f.readline()
    if not line:
        raise WorldError("the rendezvous connection closed")
    return json.loads(line)


class TcpWorld(World):
    """Rank 0 listens at MASTER_ADDR:MASTER_PORT (the address its name resolves to) and sums."""

    def __init__(self, addr: str, port: int, size: int, rank: int, timeout_s: float) -> None:
        super().__init__("tcp", size, rank)
        self.timeout_s = timeout_s
        self.peers: list[tuple[socket.socket, Any]] = []
        if rank == 0:
            self._host(addr, port)
        else:
            self._join(addr, port)

    def _host(self, addr: str, port: int) -> None:
        server = socket.create_server((addr, port), reuse_port=False)
        server.settimeout(self.timeout_s)
        seen = {0}
        try:
            while len(seen) < self.size:
                try:
                    conn, _ = server.accept()
                except TimeoutError as e:
                    raise WorldError(
                        f"rendezvous timed out after {self.timeout_s:g}s: {len(seen)}/{self.size} ranks"
                    ) from e
                conn.settimeout(self.timeout_s)
                f = conn.makefile("r")
                hello = _recv(f)
                if hello.get("world_size") != self.size or hello.get("rank") in seen:
                    _send(
                        conn,
                        {"ok": False, "error": f"rank 0 has world size {self.size}, ranks {sorted(seen)}"},
                    )
                    raise WorldError(
                        f"a rank joined as {hello}: world size {self.size}, ranks {sorted(seen)}"
                    )
                seen.add(int(hello["rank"]))
                self.peers.append((conn, f))
            for conn, _ in self.peers:
                _send(conn, {"ok": True})
        finally:
            server.close()

    def _join(self, addr: str, port: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=self.timeout_s)
                break
            except OSError as e:  # not listening yet, or the name does not resolve yet
                if time.monotonic() >= deadline:
                    raise WorldError(f"cannot reach rank 0 at {addr}:{port}: {e}") from e
                time.sleep(CONNECT_RETRY_S)
        conn.settimeout(self.timeout_s)
        f = conn.makefile("r")
        _send(conn, {"rank": self.rank, "world_size": self.size})
        answer = _recv(f)
        if not answer.get("ok"):
            raise WorldError(f"rank 0 refused rank {self.rank}: {answer.get('error')}")
        self.peers = [(conn, f)]

    def all_reduce(self, vector: list[float]) -> list[float]:
        if self.rank != 0:
            conn, f = self.peers[0]
            _send(conn, vector)
            return [float(x) for x in _recv(f)]
        total = list(vector)
        for _, f in self.peers:
            theirs = _recv(f)
            if len(theirs) != len(total):
                raise WorldError(f"a rank sent {len(theirs)} values in a world of {self.size}")
            total = [a + b for a, b in zip(total, theirs, strict=True)]
        for conn, _ in self.peers:
            _send(conn, total)
        return total

    def close(self) -> None:
        for conn, _ in self.peers:
            conn.close()


def join(backend: str, env: Mapping[str, str] | None = None, timeout_s: float = 300.0) -> World:
    env = os.environ if env is None else env
    addr, port, size, rank = world_env(env)
    if backend == "auto":
        if torch_available():
            backend = "torch"
        elif env.get("RLJOB_REQUIRE_TORCH") == "1":
            raise WorldError("RLJOB_REQUIRE_TORCH=1 but torch.distributed with gloo is not importable here")
        else:
            backend = "tcp"
    if backend == "torch":
        return TorchWorld(size, rank, timeout_s)
    if backend == "tcp":
        return TcpWorld(addr, port, size, rank, timeout_s)
    raise WorldError(f"unknown world backend {backend!r} (one of {', '.join(BACKENDS)})")
