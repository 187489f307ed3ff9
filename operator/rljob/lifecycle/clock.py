"""Timestamps in status are RFC 3339 strings; the machine converts them with these two functions."""

from __future__ import annotations

from datetime import UTC, datetime


def stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def seconds_between(start: str | None, now: datetime) -> float:
    began = parse(start)
    return max(0.0, (now - began).total_seconds()) if began else 0.0
