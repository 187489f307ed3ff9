"""A pod's part in its SGLang instance (spec.rollout.podsPerInstance pods each)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Only node rank 0 runs SGLang's HTTP server; the other nodes get release, resume and refit through the
    TP broadcast from node 0 (C-NODE)."""

    LEADER = "leader"  # node rank 0: its agent makes the instance's SGLang calls
    FOLLOWER = "follower"  # node rank > 0: its agent never calls SGLang's lifecycle routes, checks its GPUs


def role_of(index: int, pods_per_instance: int) -> Role:
    return Role.LEADER if index % pods_per_instance == 0 else Role.FOLLOWER
