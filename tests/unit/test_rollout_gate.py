"""The rollout gate's handshake (rljob.testing.rollout_gate): the trainer waits at each edge until the test
read what it needed; a test that fails reading still lets the trainer go on, and says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.testing.rollout_gate import GateKeeper, RolloutGate


def test_each_edge_waits_for_the_keeper_and_comes_in_order(tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []
    keeper = GateKeeper(tmp_path / "gate", lambda i, edge: seen.append((i, edge))).start()
    try:
        gate = RolloutGate(tmp_path / "gate", timeout=10)
        for iteration in (1, 2):
            with gate.edges(iteration):
                seen.append((iteration, "rollout"))
    finally:
        keeper.stop()
    assert seen == [(1, "start"), (1, "rollout"), (1, "end"), (2, "start"), (2, "rollout"), (2, "end")]
    assert keeper.errors == []


def test_a_failing_reader_is_recorded_and_the_trainer_goes_on(tmp_path: Path) -> None:
    def broken(iteration: int, edge: str) -> None:
        raise ConnectionError("SGLang is gone")

    keeper = GateKeeper(tmp_path, broken).start()
    try:
        RolloutGate(tmp_path, timeout=10).edge(3, "start")
    finally:
        keeper.stop()
    assert keeper.errors == ["3-start: ConnectionError: SGLang is gone"]


def test_an_edge_nobody_answers_times_out(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="nobody answered the rollout edge 1-end"):
        RolloutGate(tmp_path, timeout=0.2).edge(1, "end")
