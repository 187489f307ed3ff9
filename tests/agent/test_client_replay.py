"""Replays of real SGLang clients (slime, verl, AReaL, SGLang's own server tests) against the emulator.

Each tests/replays/<name>.json holds one RL iteration's HTTP sequence as the client's code sends it (the
format is described in the file's "format" key; sources and citations are in docs/sglang-conformance.md,
"Real clients replayed"). For each (sequence, version) the emulator is launched with the client's flags,
every step's body is sent as the exact bytes the client's HTTP library writes, with its headers, and the
reply is checked: status, and each field the client reads (present, of the right type); the sending and
checking are rljob.testing.client_replay's. The emulator must be alive at the end. A step the emulator
answers wrongly fails the test with the step's citation."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Emulator, write_weights

from rljob.testing.client_replay import STEP_TIMEOUT_S, Context, label, load, run_step, send

REPLAYS = Path(__file__).resolve().parents[1] / "replays"


def cases() -> Iterator[Any]:
    for path in sorted(REPLAYS.glob("*.json")):
        seq = load(path)
        failing_launch = seq.get("launch_fails_at", {}).get("versions", [])
        for version in seq["versions"]:
            marks = [pytest.mark.emulator_may_die] if version in failing_launch else []
            yield pytest.param(path.name, version, id=f"{path.stem}-{version}", marks=marks)


@dataclass
class Replay:
    """Sends a sequence's steps in order; background steps run in threads until the next join step."""

    emu: Emulator
    ctx: Context
    version: str
    failures: list[str] = field(default_factory=list)
    pending: list[tuple[str, threading.Thread, list[list[str]]]] = field(default_factory=list)

    def run(self, steps: list[dict[str, Any]]) -> None:
        for i, step in enumerate(steps):
            if self.version not in step.get("only_versions", [self.version]):
                continue
            if step.get("join"):
                self.join()
                continue
            if not self.emu.alive():
                self.failures.append(f"{label(i, step)}: not sent, the emulator is dead")
                return
            time.sleep(step.get("sleep_s", 0))
            if step.get("background"):
                self.start(label(i, step), step)
            else:
                self.record(label(i, step), run_step(self.emu.url, step, self.ctx)[1])
        self.join()

    def start(self, name: str, step: dict[str, Any]) -> None:
        out: list[list[str]] = []
        thread = threading.Thread(
            target=lambda: out.append(run_step(self.emu.url, step, self.ctx)[1]), daemon=True
        )
        thread.start()
        self.pending.append((name, thread, out))

    def join(self) -> None:
        for name, thread, out in self.pending:
            thread.join(STEP_TIMEOUT_S)
            if thread.is_alive() or not out:
                self.failures.append(f"{name}: no answer within {STEP_TIMEOUT_S}s")
            else:
                self.record(name, out[0])
        self.pending.clear()

    def record(self, name: str, problems: list[str]) -> None:
        if problems:
            self.failures.append(f"{name}: {'; '.join(problems)}")


@pytest.mark.parametrize(("sequence", "version"), list(cases()))
def test_client_replay(
    sequence: str, version: str, start_emulator: Callable[..., Emulator], tmp_path: Path
) -> None:
    seq = load(REPLAYS / sequence)
    ctx = Context(tmp_path)
    ctx.build_all(seq)
    write_weights(
        tmp_path / "launch-model", "1"
    )  # Emulator's --model-path: a real checkpoint, as SGLang needs
    emu = start_emulator(
        version,
        *seq["emulator_args"],
        memory_saver=False,  # the sequence's own flags say whether the client launches with it
        tps=seq.get("tokens_per_second", 0),
        env=seq.get("emulator_env"),
    )
    launch_fails = seq.get("launch_fails_at", {})
    if version in launch_fails.get("versions", []):
        try:
            code = emu.wait_exit(15)
        except subprocess.TimeoutExpired:
            code = 0
        assert code != 0, f"the emulator started, but real SGLang {version} does not: {launch_fails['why']}"
        return
    emu.wait_ready()
    replay = Replay(emu, ctx, version)
    replay.run(seq["steps"])
    if not (emu.alive() and send(emu.url, "GET", "/model_info", {}, None).status == 200):
        replay.failures.append("the emulator is not alive (or /model_info does not answer 200) at the end")
    assert not replay.failures, f"{sequence} at {version}:\n" + "\n".join(replay.failures)
