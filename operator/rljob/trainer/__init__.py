"""Trainer SDK: hand the pod's GPU between the engine's rollout and training through the in-pod agent.

from rljob.trainer import Handoff
handoff = Handoff()                      # agent URL from RLJOB_AGENT_URL (default 127.0.0.1:8472)
with handoff.train() as lease:
    ...
    lease.publish(version, path)
"""

from __future__ import annotations

from rljob.trainer.client import AgentError, AgentUnavailable
from rljob.trainer.handoff import Handoff, Lease, LeaseError, RefitSession

__all__ = ["AgentError", "AgentUnavailable", "Handoff", "Lease", "LeaseError", "RefitSession"]
