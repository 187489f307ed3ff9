"""An engine's `/metrics` as the agent reads it: Prometheus text exposition, each series it asks for summed
over its label sets. Which series, and what they mean, is each engine's (agent/engines/<name>/metrics.py)."""

from __future__ import annotations

from collections.abc import Collection


def series_sums(text: str, names: Collection[str]) -> dict[str, float]:
    """Prometheus text exposition -> {series name: sum over its label sets} for the series in `names`.
    Labels are skipped as a whole (a value may hold spaces); a line that does not parse is ignored."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, rest = line[:space], line[space:]
        if name not in names:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return sums
