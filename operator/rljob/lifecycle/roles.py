"""A pod's part in its engine instance (spec.rollout.podsPerInstance pods each)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Only node rank 0 runs the engine's HTTP server; the other nodes get release, resume and refit from
    node 0 (agent/follower.py)."""

    LEADER = "leader"  # node rank 0: its agent makes the instance's engine calls
    FOLLOWER = (
        "follower"  # node rank > 0: its agent never calls the engine's lifecycle routes, checks its GPUs
    )


def role_of(index: int, pods_per_instance: int) -> Role:
    return Role.LEADER if index % pods_per_instance == 0 else Role.FOLLOWER
