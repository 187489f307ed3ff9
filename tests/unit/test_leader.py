"""Leader election's decision (controller/leader.py): pure, on the candidate's own monotonic clock."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rljob.controller.leader import ElectionOptions, LeaderElector, LeaseRecord, Move, Sighting, next_move

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def record(holder: str | None, renew: int = 0) -> LeaseRecord:
    return LeaseRecord(holder, T0.replace(second=renew), transitions=1, resource_version=str(renew))


def test_no_lease_is_created() -> None:
    assert next_move(None, "a", Sighting(), now=0.0, lease_seconds=15) is Move.CREATE


def test_own_lease_is_renewed() -> None:
    s = Sighting()
    s.observe(record("a"), 0.0)
    assert next_move(record("a"), "a", s, now=100.0, lease_seconds=15) is Move.RENEW


def test_a_live_lease_of_another_is_left_alone_until_it_stops_changing_for_a_lease() -> None:
    s = Sighting()
    for t in (0.0, 5.0, 10.0, 14.9):  # the holder renews: every renewal resets the sighting
        s.observe(record("b", renew=int(t)), t)
        assert next_move(record("b", renew=int(t)), "a", s, now=t, lease_seconds=15) is Move.WAIT
    frozen = record("b", renew=14)
    s.observe(frozen, 20.0)  # unchanged since 14.9: the sighting keeps 14.9
    assert next_move(frozen, "a", s, now=29.8, lease_seconds=15) is Move.WAIT
    assert next_move(frozen, "a", s, now=30.0, lease_seconds=15) is Move.TAKE


def test_a_released_lease_is_taken_at_once() -> None:
    s = Sighting()
    s.observe(record(None), 0.0)
    assert next_move(record(None), "a", s, now=0.0, lease_seconds=15) is Move.TAKE


def test_the_renew_deadline_must_leave_a_gap_before_the_lease_expires() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderElector(ElectionOptions("ns", lease_seconds=10, renew_deadline_seconds=10), object())  # type: ignore[arg-type]


def test_leading_ends_when_renewals_stop_for_the_deadline() -> None:
    now = [0.0]
    elector = LeaderElector(
        ElectionOptions("ns", lease_seconds=15, renew_deadline_seconds=10),
        object(),  # type: ignore[arg-type]
        clock=lambda: now[0],
    )
    assert not elector.leading()
    elector.renewed_at = 0.0
    now[0] = 9.9
    assert elector.leading()
    now[0] = 10.0
    assert not elector.leading()
