"""The weights the pods hold, by content: each leader's agent takes its engine's checksum after every refit
and holds it against the trainer's digest and the weights before (agent/weights_check.py); here the pods of
one layout at one version are held against each other and against what the job committed, and each pod's
verification is put in words for status. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from rljob.api.agent import AgentState, WeightsCheck, WeightsComparison
from rljob.api.status import CommittedWeights

WORDS = {
    WeightsComparison.TRAINER: "trainer digest",
    WeightsComparison.PREVIOUS: "previous weights",
    WeightsComparison.COMMITTED: "committed checksum",
    WeightsComparison.REPLICAS: "DP replicas",
}


@dataclass(frozen=True)
class Held:
    """One leader's checksum at a version."""

    pod: str
    checksum: str
    layout: str


def held_at(leaders: Iterable[tuple[str, AgentState | None]], version: str | None) -> list[Held]:
    """The leaders whose agent took a checksum at `version`."""
    out = []
    for pod, agent in leaders:
        w = agent.engine.weights if agent is not None else None
        if w is not None and w.checksum is not None and w.version == version and w.layout is not None:
            out.append(Held(pod, w.checksum, w.layout))
    return out


def disagreement(held: list[Held], version: str | None) -> str | None:
    """None when the pods of each layout hold one checksum; else which pods differ from the most of theirs."""
    for layout in sorted({h.layout for h in held}):
        group = [h for h in held if h.layout == layout]
        counts = Counter(h.checksum for h in group)
        if len(counts) < 2:
            continue
        most, _ = counts.most_common(1)[0]
        odd = [h for h in group if h.checksum != most]
        agree = [h.pod for h in group if h.checksum == most]
        pods = f"pod{'s' if len(odd) > 1 else ''} {_names([h.pod for h in odd])}"
        return (
            f"{pods} hold other weights at {version} than {_names(agree)} ({layout}: checksum "
            f"{odd[0].checksum[:16]}, the others {most[:16]})"
        )
    return None


def agreed(held: list[Held]) -> tuple[str, str] | None:
    """(checksum, layout) every pod holds, where all took one in one layout."""
    if not held or len({(h.checksum, h.layout) for h in held}) != 1:
        return None
    return held[0].checksum, held[0].layout


def differs_from_committed(held: list[Held], committed: CommittedWeights) -> list[Held]:
    """The pods of the committed checksum's layout that hold other weights."""
    if committed.weights_checksum is None:
        return []
    return [
        h for h in held if h.layout == committed.weights_layout and h.checksum != committed.weights_checksum
    ]


def unverified(leaders: Iterable[tuple[str, AgentState | None]], version: str | None) -> str | None:
    """Why a leader's weights at `version` were not checked by checksum, naming it; None if all were."""
    for pod, agent in leaders:
        w = agent.engine.weights if agent is not None else None
        if w is not None and w.version == version and w.checksum is None:
            return f"pod {pod}: {w.unverified or 'weights not verified'}"
    return None


def describe(w: WeightsCheck | None, peers: int) -> str | None:
    """PodStatus.weights: what the checksum was held against (`peers`: other pods of its layout holding the
    same at the same version), or `weights not verified: <reason>`."""
    if w is None:
        return None
    if w.checksum is None:
        return w.unverified or "weights not verified"
    checked = [WORDS[c] for c in w.checked]
    if peers:
        checked.append(f"{peers} other pod{'s' if peers > 1 else ''}")
    notes = f"; {w.unverified}" if w.unverified else ""
    if not checked:
        return f"weights not verified: nothing to compare them with{notes}"[:1024]
    return f"verified: {', '.join(checked)}{notes}"[:1024]


def peers_of(held: list[Held]) -> dict[str, int]:
    """Per pod, the other pods of its layout holding the same checksum."""
    counts = Counter((h.layout, h.checksum) for h in held)
    return {h.pod: counts[(h.layout, h.checksum)] - 1 for h in held}


def _names(pods: list[str]) -> str:
    more = f" and {len(pods) - 4} more" if len(pods) > 4 else ""
    return ", ".join(pods[:4]) + more
