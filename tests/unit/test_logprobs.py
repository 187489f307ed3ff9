"""The emulator's token model and logprob assembly (rows C-GEN-LOGPROB-* of docs/sglang-conformance.md),
and the simulated trainer's loss over them: pure functions, no server."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from rljob.emulator import generation, tokens
from rljob.emulator.bodies import GenerateBody
from rljob.testing.trainer import BadRollout, policy_gradient_loss, reward, token_logprobs

CONTEXT = [11, 22, 33, 44]


def _total_mass(d: tokens.Distribution, temperature: float) -> float:
    tail = (tokens.VOCAB - len(d.ids)) * math.exp(d.logprob(-1, temperature))
    return sum(math.exp(d.logprob(t, temperature)) for t in d.ids) + tail


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_distribution_is_normalized_and_logprobs_are_nonpositive(temperature: float) -> None:
    d = tokens.distribution("w", CONTEXT)
    assert len(set(d.ids)) == tokens.CANDIDATES
    assert _total_mass(d, temperature) == pytest.approx(1.0, abs=1e-9)
    assert all(d.logprob(t, temperature) <= 0 for t in [*d.ids, 0, 49_999])


def test_top_is_sorted_consistent_and_continues_into_the_tail() -> None:
    d = tokens.distribution("w", CONTEXT)
    top = d.top(tokens.CANDIDATES + 3, 0.7)
    values = [lp for lp, _ in top]
    assert values == sorted(values, reverse=True)
    assert all(lp == pytest.approx(d.logprob(t, 0.7)) for lp, t in top)
    tail = top[tokens.CANDIDATES :]
    assert [t for _, t in tail] == sorted(t for _, t in tail)  # ties in ascending id
    assert all(t not in d.ids for _, t in tail)


def test_distribution_depends_on_weights_and_context() -> None:
    assert tokens.distribution("w", CONTEXT) == tokens.distribution("w", list(CONTEXT))
    assert tokens.distribution("w", CONTEXT) != tokens.distribution("v", CONTEXT)
    assert tokens.distribution("w", CONTEXT) != tokens.distribution("w", [*CONTEXT, 5])


def _draws(params: tokens.SamplingParams, n: int) -> Counter[int]:
    return Counter(tokens.Sampler(params, s).next_token("w", CONTEXT) for s in range(n))


def test_sampling_follows_the_distribution_and_is_reproducible() -> None:
    d = tokens.distribution("w", CONTEXT)
    params = tokens.SamplingParams(temperature=1.0, seed=7)
    counts = _draws(params, 4000)
    assert counts == _draws(params, 4000)  # the same seed: the same draws
    assert counts != _draws(tokens.SamplingParams(temperature=1.0, seed=8), 4000)
    for lp, t in d.top(3):
        assert counts[t] / 4000 == pytest.approx(math.exp(lp), abs=0.03)


def test_greedy_is_the_argmax_and_its_logprob_is_taken_at_temperature_one() -> None:
    d = tokens.distribution("w", CONTEXT)
    for params in (tokens.SamplingParams(temperature=0.0, seed=3), tokens.SamplingParams(top_k=1)):
        assert set(_draws(params, 50)) == {d.ids[0]}
        assert params.logprob_temperature == 1.0
    assert tokens.SamplingParams(temperature=0.6).logprob_temperature == 0.6


def test_top_k_and_top_p_restrict_the_draws() -> None:
    d = tokens.distribution("w", CONTEXT)
    assert set(_draws(tokens.SamplingParams(top_k=3), 600)) <= set(d.ids[:3])
    cumulative, keep = 0.0, 0
    while cumulative < 0.5:
        cumulative += math.exp(d.logprob(d.ids[keep]))
        keep += 1
    assert set(_draws(tokens.SamplingParams(top_p=0.5), 600)) <= set(d.ids[:keep])


@pytest.mark.parametrize(
    ("order", "at_limit"),
    [(("length", "token", "str"), None), (("str", "token", "length"), {"type": "stop", "matched": 9})],
    ids=["0.5.6-length-first", "0.5.20-length-last"],
)
def test_stop_reasons(order: tuple[str, ...], at_limit: dict[str, Any] | None) -> None:
    params = tokens.SamplingParams(stop=("t7 t8",), stop_token_ids=frozenset({9}))
    sampler = tokens.Sampler(params, order=order)
    assert sampler.stop_reason([1, 9], 8) == {"type": "stop", "matched": 9}
    assert sampler.stop_reason([1, 9], 2) == at_limit  # a stop on the last allowed token
    assert sampler.stop_reason([5, 7, 8], 8) == {"type": "stop", "matched": "t7 t8"}
    eos = [1, tokens.EOS_TOKEN_ID]
    assert sampler.stop_reason(eos, 8) == {"type": "stop", "matched": tokens.EOS_TOKEN_ID}
    ignoring = tokens.Sampler(
        tokens.SamplingParams(ignore_eos=True, stop_token_ids=frozenset({9})), order=order
    )
    assert ignoring.stop_reason(eos, 8) is None and ignoring.stop_reason([1, 9], 8) is None


def _item(**fields: Any) -> generation.Item:
    items, _ = generation.normalize(GenerateBody.model_validate({"input_ids": [5, 6, 7, 8], **fields}))
    return items[0]


def test_input_logprobs_start_with_none_then_score_each_prompt_token() -> None:
    item = _item(return_logprob=True, logprob_start_len=1, top_logprobs_num=2, token_ids_logprob=[6, 100])
    out = generation.input_logprobs(item, "w", 1)
    assert out["token"][0] == (None, 6, None) and out["top"][0] is None and out["ids"][0] is None
    for j, (lp, tok, _) in enumerate(out["token"][1:], start=2):
        d = tokens.distribution("w", item.prompt[:j])
        assert tok == item.prompt[j] and lp == pytest.approx(d.logprob(tok))
        assert [t for _, t, _ in out["top"][j - 1]] == list(d.ids[:2])
        assert [t for _, t, _ in out["ids"][j - 1]] == [6, 100]


def test_logprob_start_len_default_per_version() -> None:
    item = _item(return_logprob=True)
    assert generation.resolved_start(item, new_default=False) == 3  # 0.5.6: the last prompt token
    assert generation.resolved_start(item, new_default=True) == 4  # 0.5.15+: no input logprobs
    assert generation.start_error(_item(logprob_start_len=4), 4, new_default=True) is None
    assert "is higher than the number of input tokens" in str(
        generation.start_error(_item(logprob_start_len=4), 4, new_default=False)
    )


def test_output_logprobs_score_each_token_under_its_own_weights() -> None:
    item = _item(return_logprob=True, sampling_params={"temperature": 0.5}, return_text_in_logprobs=True)
    out = generation.output_logprobs(item, [40, 41], ["w1", "w2"])
    d1 = tokens.distribution("w2", [*item.prompt, 40])
    assert out["token"][1] == (pytest.approx(d1.logprob(41, 0.5)), 41, "t41")


def test_batch_normalization() -> None:
    items, batch = generation.normalize(
        GenerateBody.model_validate({"text": ["a b", "c"], "rid": "r", "sampling_params": {"n": 2}})
    )
    assert batch and [i.prompt for i in items] == [tokens.encode("a b")] * 2 + [tokens.encode("c")] * 2
    assert len({i.rid for i in items}) == 4 and all(i.parallel for i in items)
    items, _ = generation.normalize(GenerateBody.model_validate({"text": ["a", "b"], "rid": "r"}))
    assert [i.rid for i in items] == ["r_0", "r_1"]
    with pytest.raises(generation.GenerateError, match="parallel_sample_num"):
        generation.normalize(
            GenerateBody.model_validate(
                {"text": ["a"], "return_logprob": [True], "sampling_params": {"n": 2}}
            )
        )


def _answer(ids: list[int], lps: list[Any] | None, finish: str = "length") -> dict[str, Any]:
    meta: dict[str, Any] = {"id": "x", "finish_reason": {"type": finish}}
    if lps is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
    return {"output_ids": ids, "meta_info": meta}


def test_policy_gradient_loss_uses_the_returned_logprobs() -> None:
    a, b = _answer([2, 4], [-1.0, -3.0]), _answer([1, 3], [-0.5, -0.5])
    aborted = _answer([6], [-9.0], finish="abort")
    stats = policy_gradient_loss([[a, b, aborted]])
    # rewards 1 and 0, baseline 0.5: loss = -mean(0.5 * -2.0, -0.5 * -0.5)
    assert stats["loss"] == pytest.approx(-(0.5 * -2.0 + -0.5 * -0.5) / 2)
    assert stats["scored"] == 2 and stats["reward"] == 0.5 and reward([2, 3]) == 0.5


@pytest.mark.parametrize(
    "answer",
    [_answer([1, 2], None), _answer([1, 2], [-1.0, None]), _answer([1, 2], [-1.0, 0.5])],
    ids=["missing", "none", "positive"],
)
def test_unusable_logprobs_fail_loudly(answer: dict[str, Any]) -> None:
    with pytest.raises(BadRollout):
        token_logprobs(answer)
    with pytest.raises(BadRollout):
        policy_gradient_loss([[answer]])
