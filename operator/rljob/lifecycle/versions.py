"""Weight-version ordering. An engine's versions are strings; ours must move forward.

Numeric versions (the trainer SDK's default: the optimizer step) compare as numbers; any other string
is "newer" when it has never been committed before, so a version can never come back."""

from __future__ import annotations

from collections.abc import Iterable


def _as_int(version: str) -> int | None:
    return int(version) if version.isdigit() else None


def is_newer(candidate: str, committed: Iterable[str]) -> bool:
    seen = list(committed)
    if candidate in seen:
        return False
    number = _as_int(candidate)
    if number is None:
        return True
    numbers = [n for n in (_as_int(v) for v in seen) if n is not None]
    return all(number > n for n in numbers)
