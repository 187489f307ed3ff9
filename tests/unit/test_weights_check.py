"""agent/weights_check.py: SGLang's /weights_checker reply read as each version writes it (C-CHECKER-CHECKSUM)
and held against what the weights must be after a refit: a mismatch names the parameters."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from rljob.agent.engines.sglang.weights import read_reply
from rljob.agent.weights_check import Expected, Held, judge
from rljob.api.agent import WeightsCheck, WeightsComparison, WeightsDigest

A, B, C = "a" * 16, "b" * 16, "c" * 16


def rank(checksums: dict[str, str], tp: int = 0, tp_size: int = 1, dp: int = 0, roles: bool = False) -> dict:  # type: ignore[type-arg]
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    info: Any = {"tp_rank": tp, "tp_size": tp_size, "dp_rank": dp, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                 "rank": tp, "size": tp_size}  # fmt: skip
    if roles:  # 0.5.21+: one entry per role
        info = [{"role": "draft", **info}, {"role": "target", **info}]
    return {"checksums": checksums, "per_gpu_checksum": h.hexdigest(), "parallelism_info": info}


def held(params: dict[str, str], **kw: Any) -> Held:
    return read_reply({"success": True, "ranks": [rank(params, **kw)], "per_engine_checksum": "x"})


def check_of(h: Held, version: str) -> WeightsCheck:
    return WeightsCheck(version=version, checksum=h.checksum, layout=h.layout)


def test_both_reply_layouts_read_the_same() -> None:
    old, new = held({"w": A}), held({"w": A}, roles=True)
    assert old.checksum == new.checksum and old.layout == new.layout == "tp1 pp1"
    assert old.whole == {"w": A}
    with pytest.raises(ValueError):
        read_reply({"success": True})


def test_the_checksum_does_not_depend_on_the_ranks_answer_order() -> None:
    r0, r1 = rank({"w": A}, tp=0, tp_size=2), rank({"w": B}, tp=1, tp_size=2)
    one = read_reply({"ranks": [r0, r1]})
    other = read_reply({"ranks": [r1, r0]})
    assert one.checksum == other.checksum and one.layout == "tp2 pp1" and one.whole is None


def test_the_trainers_digest_held_and_changed_from_before() -> None:
    before = held({"w": A, "v": A})
    after = held({"w": B, "v": B})
    want = Expected("2", True, WeightsDigest(parameters={"w": B, "v": B}), previous=check_of(before, "1"),
                    previous_held=before)  # fmt: skip
    v = judge(after, want)
    assert v.failures == [] and v.checked == [WeightsComparison.TRAINER, WeightsComparison.PREVIOUS]


def test_a_parameter_not_what_the_trainer_published_is_named() -> None:
    after = held({"w": B, "v": C})
    v = judge(after, Expected("2", True, WeightsDigest(parameters={"w": B, "v": B})))
    assert (
        len(v.failures) == 1
        and "SGLang's v is not what the trainer published (v: published bbbb" in v.failures[0]
    )


def test_a_tensor_under_a_name_the_model_lacks_is_named() -> None:
    after = held({"w": B})
    v = judge(after, Expected("2", True, WeightsDigest(parameters={"w": B, "w_typo": C})))
    assert "published w_typo but SGLang has no such parameter" in v.failures[0]


def test_a_parameter_the_trainer_did_not_push_must_not_change() -> None:
    before = held({"w": A, "frozen": A})
    after = held({"w": B, "frozen": C})
    want = Expected("2", True, WeightsDigest(parameters={"w": B}), previous=check_of(before, "1"),
                    previous_held=before)  # fmt: skip
    v = judge(after, want)
    assert "frozen, which the trainer did not publish, changed in the refit" in v.failures[0]


def test_new_weights_that_hash_as_before_moved_nothing() -> None:
    before = held({"w": A})
    v = judge(held({"w": A}), Expected("2", True, previous=check_of(before, "1")))
    assert "moved nothing" in v.failures[0] and "version 1" in v.failures[0]
    # after a release that discarded them: the look right before the load is what "before" means
    garbage = held({"w": C})
    v = judge(held({"w": C}), Expected("2", True, previous=check_of(before, "1"), before_load=garbage))
    assert "moved nothing" in v.failures[0] and "before the load" in v.failures[0]
    v = judge(held({"w": B}), Expected("2", True, previous=check_of(before, "1"), before_load=garbage))
    assert v.failures == [] and WeightsComparison.PREVIOUS in v.checked


def test_the_same_weights_as_before_pass_when_the_trainers_digest_says_so() -> None:
    before = held({"w": A})
    v = judge(
        held({"w": A}),
        Expected("2", True, WeightsDigest(parameters={"w": A}), previous=check_of(before, "1")),
    )
    assert v.failures == [] and any("as the trainer's digest says" in n for n in v.not_checked)


def test_a_reload_must_bring_back_the_same_weights() -> None:
    before = held({"w": A})
    assert judge(
        held({"w": A}), Expected("1", False, reload=True, previous=check_of(before, "1"))
    ).checked == [WeightsComparison.PREVIOUS]
    v = judge(
        held({"w": B}),
        Expected("1", False, reload=True, previous=check_of(before, "1"), previous_held=before),
    )
    assert "other weights after bringing back 1" in v.failures[0] and "w changed" in v.failures[0]


def test_a_rejoin_must_hold_the_committed_checksum() -> None:
    good = held({"w": B})
    want = Expected("3", False, committed_checksum=good.checksum, committed_layout=good.layout)
    assert judge(good, want).checked == [WeightsComparison.COMMITTED]
    v = judge(held({"w": A}), want)
    assert "does not hold the committed weights 3" in v.failures[0]


def test_sharded_or_quantized_weights_are_not_compared_with_the_digest_and_it_is_said() -> None:
    digest = WeightsDigest(parameters={"w": A})
    sharded = read_reply({"ranks": [rank({"w": A}, 0, 2), rank({"w": B}, 1, 2)]})
    v = judge(sharded, Expected("2", True, digest))
    assert v.failures == [] and "sharded (tp2 pp1)" in v.not_checked[0]
    v = judge(held({"w": B}), Expected("2", True, digest, whole_tensors="quantized"))
    assert v.failures == [] and "quantized" in v.not_checked[0]
    v = judge(held({"w": B}), Expected("2", True, None, no_digest="the trainer gave no digest"))
    assert v.checked == [] and "the trainer gave no digest" in v.not_checked[0]


def test_dp_replicas_must_agree() -> None:
    reply = {"ranks": [rank({"w": A}, dp=0), rank({"w": B}, dp=1)]}
    v = judge(read_reply(reply), Expected("2", False))
    assert "DP rank 1 (pp 0, tp 0) differs from DP rank 0 in w" in v.failures[0]
