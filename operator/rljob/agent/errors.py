"""Errors the agent turns into HTTP answers or command outcomes."""

from __future__ import annotations


class Refused(Exception):
    """The agent refuses a request instead of forwarding it (body: Refusal)."""

    def __init__(self, status: int, error: str, reason: str, *, permanent: bool = False) -> None:
        super().__init__(f"{error}: {reason}")
        self.status, self.error, self.reason = status, error, reason
        self.permanent = permanent  # the spec or the engine's launch forbids it: no retry or new gang helps


def conflict(error: str, reason: str) -> Refused:
    """A refusal the state of the moment explains: the same command may be taken later."""
    return Refused(409, error, reason)


def forbidden_by_launch(error: str, reason: str) -> Refused:
    """A refusal that the engine's version or launch flags, or the spec, make certain for every retry and
    every new gang: the operator fails the job with `error` (docs/lifecycle.md, "Permanent refusals")."""
    return Refused(409, error, reason, permanent=True)


class CommandFailed(Exception):
    """A command ran and did not reach its target stage; the agent is still consistent. `reason`: a typed
    name the command's status carries (CommandStatus.failure_reason), e.g. WeightsMismatch."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class PermanentFailure(CommandFailed):
    """A failure any retry would repeat (the spec asks what this pod can never do): the command's
    status says `permanent` with `reason`, and the operator fails the job instead of restarting it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, reason)


class StateLost(Exception):
    """The engine's state is no longer known (a non-idempotent call did not answer in time): the pod must
    go."""
