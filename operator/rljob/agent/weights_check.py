"""What the engine holds, by content: its checksum of every parameter (Engine.read_weights) held against
what it must equal after a refit (docs/agent.md, "Verified weights"). Pure: operations.py makes the call.

- **Trainer**: the trainer's digest of what it published or pushed (rljob.trainer.engines: the engine's
  hash), parameter by parameter; a parameter it did not push must be what it was before the refit. Only
  where the engine holds whole tensors (TP 1, PP 1) and the model is not quantized: the digest hashes
  whole, unquantized tensors.
- **Previous**: the weights before the refit. New weights that hash the same moved nothing (unless the
  trainer's digest says they are the same); a reload of the committed version must hash the same.
- **Committed**: a rejoin or a reload must hold what the job verified when it committed the version.
- **Replicas**: every DP replica of the pod holds the same weights.

The operator then compares the pods of one layout at one version (lifecycle/weights.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from rljob.api.agent import WeightsCheck, WeightsComparison, WeightsDigest

WEIGHTS_MISMATCH = "WeightsMismatch"  # CommandStatus.failure_reason of a refit whose weights are wrong
NAMED = 5  # parameters named in a message, then a count


@dataclass(frozen=True)
class GpuHashes:
    """One GPU's answer: its place in the layout, its checksum and its parameters' hashes."""

    dp: int
    pp: int
    tp: int
    per_gpu: str
    parameters: Mapping[str, str]


@dataclass(frozen=True)
class Held:
    """What the engine holds, from one checksum of its weights."""

    gpus: tuple[GpuHashes, ...]
    tp_size: int
    pp_size: int
    engine: str = "the engine"  # how messages name it

    @property
    def layout(self) -> str:
        """What makes two pods' checksums comparable: TP and PP shard the weights, DP replicates them."""
        return f"tp{self.tp_size} pp{self.pp_size}"

    def shards(self) -> dict[tuple[int, int], GpuHashes]:
        """One GPU per (pp, tp) place: the lowest DP rank's."""
        out: dict[tuple[int, int], GpuHashes] = {}
        for g in sorted(self.gpus, key=lambda g: (g.dp, g.pp, g.tp)):
            out.setdefault((g.pp, g.tp), g)
        return out

    @property
    def checksum(self) -> str:
        """sha256 over the per-GPU checksums in (pp, tp) order: equal on pods that hold the same weights in
        the same layout, whatever order the engine's ranks answered in (an engine's own checksum over its
        GPUs may follow the arrival order)."""
        h = hashlib.sha256()
        for (pp, tp), g in sorted(self.shards().items()):
            h.update(f"{pp}:{tp}:{g.per_gpu}\n".encode())
        return h.hexdigest()

    @property
    def whole(self) -> Mapping[str, str] | None:
        """The parameters' hashes when one GPU holds them whole (TP 1, PP 1), else None."""
        shards = self.shards()
        return shards[(0, 0)].parameters if self.tp_size == self.pp_size == 1 and (0, 0) in shards else None

    @property
    def parameters(self) -> int:
        return max((len(g.parameters) for g in self.gpus), default=0)

    def replicas_differ(self) -> list[str]:
        """The DP replicas whose weights are not their DP rank 0's."""
        shards = self.shards()
        out = []
        for g in self.gpus:
            first = shards[(g.pp, g.tp)]
            if g is not first and g.per_gpu != first.per_gpu:
                names = _differing(first.parameters, g.parameters)
                out.append(
                    f"DP rank {g.dp} (pp {g.pp}, tp {g.tp}) differs from DP rank {first.dp} in {names}"
                )
        return out


@dataclass(frozen=True)
class Expected:
    """What the weights after a refit must be."""

    version: str
    new_weights: bool  # a newly published version (not a reload, not a rejoin)
    digest: WeightsDigest | None = None  # the trainer's, for this version
    no_digest: str = "the trainer gave no digest"  # why `digest` is None
    previous: WeightsCheck | None = None  # the agent's last look, before this refit
    previous_held: Held | None = None  # its parameters (lost when the agent restarted)
    before_load: Held | None = (
        None  # the resumed weights right before the load, where the release discarded them
    )
    committed_checksum: str | None = None
    committed_layout: str | None = None
    whole_tensors: str | None = None  # why the engine's parameters are not whole tensors (quantized), or None
    reload: bool = False  # the committed version again after a lease without weights: what was there before


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    checked: list[WeightsComparison] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)

    def report(self, held: Held, version: str | None) -> WeightsCheck:
        return WeightsCheck(
            version=version,
            checksum=held.checksum,
            layout=held.layout,
            parameters=held.parameters,
            checked=list(dict.fromkeys(self.checked)),
            unverified="; ".join(self.not_checked)[:1024] or None,
            mismatch="; ".join(self.failures)[:1024] or None,
        )


def judge(held: Held, want: Expected) -> Verdict:
    """Every comparison `want` allows, the failures naming the parameters."""
    v = Verdict()
    _replicas(held, v)
    trainer_held = _trainer(held, want, v)
    _previous(held, want, v, trainer_held)
    _committed(held, want, v)
    return v


def _replicas(held: Held, v: Verdict) -> None:
    if len(held.gpus) == len(held.shards()):
        return
    differ = held.replicas_differ()
    if differ:
        v.failures.append(
            f"{held.engine}'s data-parallel replicas hold different weights: " + "; ".join(differ)
        )
    else:
        v.checked.append(WeightsComparison.REPLICAS)


def _trainer(held: Held, want: Expected, v: Verdict) -> bool:
    """The trainer's digest against the engine's parameters; True when it ran and held."""
    if not want.new_weights:
        return False
    whole = held.whole
    why = None
    if want.digest is None:
        why = want.no_digest
    elif want.digest.unavailable:
        why = f"the trainer gave none: {want.digest.unavailable}"
    elif want.whole_tensors is not None:
        why = want.whole_tensors
    elif whole is None:
        why = f"{held.engine} holds its parameters sharded ({held.layout}); the digest hashes whole tensors"
    if why is not None:
        v.not_checked.append(f"not compared with the trainer's digest: {why}")
        return False
    assert want.digest is not None and whole is not None
    digest = want.digest.parameters
    absent = sorted(n for n in digest if n not in whole)
    differ = sorted(n for n in digest if n in whole and whole[n] != digest[n])
    failures = []
    if absent:
        failures.append(
            f"the trainer published {_names(absent)} but {held.engine} has no such parameter (its loader "
            "skips a tensor whose name the model does not have)"
        )
    if differ:
        failures.append(f"{held.engine}'s {_names(differ)} {'is' if len(differ) == 1 else 'are'} not what "
                        f"the trainer published ({_pair(held, digest, whole, differ[0])})")  # fmt: skip
    before = want.previous_held.whole if want.previous_held is not None else None
    unpushed = sorted(n for n in whole if n not in digest)
    if unpushed and before is not None:
        changed = sorted(n for n in unpushed if before.get(n) != whole[n])
        if changed:
            failures.append(
                f"{_names(changed)}, which the trainer did not publish, changed in the refit "
                f"({_pair(held, before, whole, changed[0], 'before')}): a release without CPU backup leaves "
                "only what is loaded again"
            )
    elif unpushed:
        v.not_checked.append(
            f"{len(unpushed)} parameters the trainer did not publish not compared (the agent has no "
            "look at them before the refit)"
        )
    if failures:
        v.failures.append(
            f"the weights {held.engine} holds at {want.version} are not the trainer's: " + "; ".join(failures)
        )
        return False
    v.checked.append(WeightsComparison.TRAINER)
    return True


def _previous(held: Held, want: Expected, v: Verdict, trainer_held: bool) -> None:
    if want.new_weights and want.before_load is not None:
        _moved(held, want.before_load, want.version, "before the load (the weights the release left)", v,
               trainer_held)  # fmt: skip
        return
    if not want.new_weights and not want.reload:
        return  # a rejoin: the committed checksum says what it must hold (_committed)
    prev = want.previous
    if prev is None or prev.checksum is None:
        v.not_checked.append(
            "not compared with the weights before the refit: the agent took no checksum then"
        )
        return
    if prev.mismatch is not None:
        v.not_checked.append("not compared with the weights before the refit: they failed their own check")
        return
    if prev.layout != held.layout:
        v.not_checked.append(
            f"not compared with the weights before the refit: another layout ({prev.layout})"
        )
        return
    same = prev.checksum == held.checksum
    if want.new_weights:
        if prev.version == want.version:
            v.not_checked.append(
                f"not compared with the weights before the refit: they were already {want.version}"
            )
            return
        _moved(held, None, want.version, f"before it (version {prev.version})", v, trainer_held, same)
        return
    if prev.version != want.version:
        v.not_checked.append(f"not compared with the weights before the refit: they were {prev.version}")
        return
    if not same:
        before = want.previous_held.whole if want.previous_held is not None else None
        whole = held.whole
        changed = (
            f" ({_differing(before, whole)} changed)" if before is not None and whole is not None else ""
        )
        v.failures.append(
            f"{held.engine} holds other weights after bringing back {want.version} than it verified at "
            f"{want.version} before (checksum {prev.checksum[:16]}, now {held.checksum[:16]}){changed}"
        )
        return
    v.checked.append(WeightsComparison.PREVIOUS)


def _moved(
    held: Held,
    before: Held | None,
    version: str,
    when: str,
    v: Verdict,
    trainer_held: bool,
    same: bool | None = None,
) -> None:
    """New weights must differ from what the engine held before the load, unless the trainer's digest says
    so."""
    if same is None:
        same = before is not None and before.checksum == held.checksum
    if same and not trainer_held:
        v.failures.append(
            f"{held.engine} holds the same weights after the refit to {version} as {when} (checksum "
            f"{held.checksum[:16]}): the load answered success and moved nothing"
        )
        return
    v.checked.append(WeightsComparison.PREVIOUS)
    if same:
        v.not_checked.append(f"the same weights as {when}, as the trainer's digest says")


def _committed(held: Held, want: Expected, v: Verdict) -> None:
    if want.committed_checksum is None or want.new_weights:
        return
    if want.committed_layout not in (None, held.layout):
        v.not_checked.append(
            f"not compared with the committed checksum: taken in another layout ({want.committed_layout})"
        )
        return
    if want.committed_checksum != held.checksum:
        v.failures.append(
            f"{held.engine} does not hold the committed weights {want.version}: checksum "
            f"{held.checksum[:16]}, the job verified {want.committed_checksum[:16]} when it committed them "
            "(launch weights, or a load that moved nothing?)"
        )
        return
    v.checked.append(WeightsComparison.COMMITTED)


def unverified(reason: str, version: str | None) -> WeightsCheck:
    """No checksum at all: the status says so, never that the weights were verified."""
    return WeightsCheck(version=version, unverified=f"weights not verified: {reason}"[:1024])


def _differing(a: Mapping[str, str], b: Mapping[str, str]) -> str:
    names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    return _names(names) if names else "no parameter"


def _pair(
    held: Held, expected: Mapping[str, str], actual: Mapping[str, str], name: str, label: str = "published"
) -> str:
    return f"{name}: {label} {expected.get(name, '-')}, {held.engine} {actual.get(name, '-')}"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMED])
    return shown + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
