"""The trainer's GPU lease: requested by the trainer, granted by the operator (only after verified
release), returned by publish (or abandon). Trainer-side state lives in AgentState.trainer."""

from __future__ import annotations

import time
from collections.abc import Callable

from rljob.agent.errors import conflict
from rljob.agent.state import StateStore
from rljob.api.agent import AgentState, LeaseStatus, PublishRequest, Stage, TrainerReport


class LeaseDesk:
    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._granted_at: float | None = None  # monotonic; unknown to a restarted agent

    def _returned(self) -> float | None:
        """The lease came back: its seconds with the trainer (the Training span's own part, not the control
        plane's: lifecycle/timeline.py record_trainer_seconds), and no grant is open any more."""
        granted, self._granted_at = self._granted_at, None
        return round(time.monotonic() - granted, 6) if granted is not None else None

    def _report(self) -> TrainerReport:
        return self._store.state.trainer.model_copy()

    def request(self) -> TrainerReport:
        st = self._store.state
        if st.stage == Stage.FAILED:
            raise conflict("AgentFailed", f"the pod must be replaced: {st.fatal}")
        if st.trainer.lease_held:
            raise conflict("LeaseHeld", "the trainer already holds the GPU lease")
        if not st.trainer.requested:  # asking twice keeps the first request's epoch
            with self._store.change() as s:
                s.trainer.requested = True
                s.trainer.request_epoch = s.epoch
                s.trainer.error = None
                s.trainer.last_refusal = None
        return self._report()

    def status(self) -> LeaseStatus:
        t = self._store.state.trainer
        return LeaseStatus(granted=t.lease_held, epoch=self._store.lease_epoch if t.lease_held else None)

    async def wait_granted(self, wait: float) -> LeaseStatus:
        st = self._store.state
        await self._store.wait_until(lambda: st.trainer.lease_held or st.stage == Stage.FAILED, wait)
        return self.status()

    def grant(self, epoch: int) -> Callable[[AgentState], None]:
        """The grant command's record, written with its move to Granted (agent/actions.py)."""
        self._store.lease_epoch = epoch
        self._granted_at = time.monotonic()
        return _granted

    def publish(self, req: PublishRequest) -> TrainerReport:
        st = self._store.state
        t = st.trainer
        granted = self._store.lease_epoch
        replay = (t.published_version, t.published_path) == (req.version, req.path)
        if replay and not t.lease_held and granted is not None and t.published_epoch == granted:
            return self._report()  # the same publish again: its answer was lost (the agent restarted)
        if not st.trainer.lease_held:
            raise conflict("NoLease", "publish needs the GPU lease (wait for it with GET /v1/trainer/lease)")
        why = "the trainer gave no digest with its publish (Lease.publish(version, path, digest=...))"
        self._store.trainer_digest = (req.version, req.digest, why)
        with self._store.change(stage=Stage.TRAINED) as s:
            s.trainer.published_version = req.version
            s.trainer.published_path = req.path
            s.trainer.published_epoch = self._store.lease_epoch
            s.trainer.lease_held = False
            s.trainer.held_seconds = self._returned()
            s.trainer.last_refusal = None  # accepted: see `accepted`
        return self._report()

    def return_unchanged(self) -> TrainerReport:
        """The trainer gives the lease back without new weights (a framework's release, then resume with
        nothing pushed): the operator brings back the committed version and records none."""
        if not self._store.state.trainer.lease_held:
            raise conflict("NoLease", "no lease to give back")
        with self._store.change(stage=Stage.TRAINED) as s:
            s.trainer.returned_epoch = self._store.lease_epoch
            s.trainer.lease_held = False
            s.trainer.held_seconds = self._returned()
        return self._report()

    def refused(self, reason: str) -> None:
        """The agent refused a call of the trainer: kept for the operator until its next accepted call."""
        if self._store.state.trainer.last_refusal != reason[:1024]:
            with self._store.change() as s:
                s.trainer.last_refusal = reason[:1024]

    def accepted(self) -> None:
        """The agent took a handoff call of the trainer (a request, publish, push, load, resume, a window
        closed without an error): a refusal before it was recovered from and must not be blamed for a
        later end of the trainer. Reads, generation and calls that report a failure do not count."""
        if self._store.state.trainer.last_refusal is not None:
            with self._store.change() as s:
                s.trainer.last_refusal = None

    def abandon(self, reason: str) -> TrainerReport:
        if not self._store.state.trainer.lease_held:
            raise conflict("NoLease", "no lease to return")
        with self._store.change() as s:
            s.trainer.lease_held = False
            s.trainer.error = reason[:1024]
            s.trainer.held_seconds = self._returned()
        return self._report()


def _granted(s: AgentState) -> None:
    s.trainer.lease_held = True
    s.trainer.requested = False
    s.trainer.error = None
    s.trainer.held_seconds = None
