"""A handshake at the edges of a trainer's rollout, for a test that reads SGLang's own `/metrics` there.

The trainer (`RolloutGate`) writes `<iteration>-start` in a directory both can see (the job's volume) before
its first rollout request and `<iteration>-end` after its last answer, and waits each time until the test
(`GateKeeper`) has answered with `<name>.seen`. The test reads what it needs when an edge file appears: no
token of the rollout is generated outside its two reads, and none of another request inside them.

    gate = RolloutGate(Path("/weights/gate"))           # the trainer
    with gate.edges(iteration): rollout.run(...)

    keeper = GateKeeper(claim / "gate", on_edge).start()  # the test: on_edge(iteration, "start" | "end")
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("rljob.testing.rollout_gate")

EDGES = ("start", "end")
SEEN = ".seen"


def _touch(path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("")
    tmp.replace(path)  # appears whole


class RolloutGate:
    """The trainer's side: each edge waits for the test's answer (TimeoutError after `timeout` seconds)."""

    def __init__(self, directory: Path, timeout: float = 120.0, poll: float = 0.005) -> None:
        self.directory = directory
        self.timeout = timeout
        self.poll = poll

    def edge(self, iteration: int, edge: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{iteration}-{edge}"
        _touch(self.directory / name)
        seen = self.directory / (name + SEEN)
        deadline = time.monotonic() + self.timeout
        while not seen.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody answered the rollout edge {name} in {self.directory}")
            time.sleep(self.poll)

    @contextlib.contextmanager
    def edges(self, iteration: int) -> Iterator[None]:
        self.edge(iteration, "start")
        yield
        self.edge(iteration, "end")


class GateKeeper:
    """The test's side: a thread that calls `on_edge(iteration, edge)` for every new edge file, then answers
    it. An exception in `on_edge` is kept in `errors` and the edge is still answered (the trainer goes on;
    the test fails on `errors`)."""

    def __init__(self, directory: Path, on_edge: Callable[[int, str], None], poll: float = 0.005) -> None:
        self.directory = directory
        self.on_edge = on_edge
        self.poll = poll
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout gate keeper", daemon=True)

    def start(self) -> GateKeeper:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            for path in sorted(self.directory.iterdir()):
                iteration, _, edge = path.name.partition("-")
                if not iteration.isdigit() or edge not in EDGES:
                    continue
                answer = path.with_name(path.name + SEEN)
                if answer.exists():
                    continue
                try:
                    self.on_edge(int(iteration), edge)
                except Exception as exc:  # the test reads errors; the trainer must not hang on us
                    log.exception("rollout edge %s", path.name)
                    self.errors.append(f"{path.name}: {type(exc).__name__}: {exc}")
                _touch(answer)
