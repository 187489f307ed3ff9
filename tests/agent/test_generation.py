"""`/generate` as RL clients use it, against the emulator process of each version: logprobs, meta_info
layout, streaming, parallel samples, stops, errors (rows C-GEN-* of docs/sglang-conformance.md), and the
simulated trainer's rollout loss over the returned logprobs."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from agent_procs import VERSIONS, Emulator

from rljob.testing.trainer import Rollout

PROMPT = "sys0 sys1 sys2 what is two plus two"


def _generate(emu: Emulator, body: dict[str, Any]) -> Any:
    r = emu.call("POST", "/generate", body)
    assert r.status == 200, r.text
    return r.body


def _keys(version: str, *, logprob: bool, top: bool, ids: bool, spans: bool) -> list[str]:
    """meta_info's keys in the order the version's tokenizer builds them."""
    old = version == "0.5.6"
    keys = ["id", "finish_reason", "prompt_tokens", "weight_version"]
    keys.append("total_retractions" if version in ("0.5.6", "0.5.10.post1") else "num_retractions")
    if logprob:
        keys += ["input_token_logprobs", "output_token_logprobs"]
        keys += [] if old else ["output_token_logprobs_length"]
        keys += ["input_top_logprobs", "output_top_logprobs"] if top else []
        keys += ["input_token_ids_logprobs", "output_token_ids_logprobs"] if ids else []
    keys += [] if old else ["reasoning_tokens"]
    keys += ["completion_tokens", "cached_tokens"]
    keys += ["weight_versions"] if spans else []
    # None or {"device", "host"} from 0.5.15.post1 (…/managers/tokenizer_manager.py:1922-1929@0.5.15.post1,
    # …/managers/scheduler_components/output_streamer.py:60-88@0.5.15.post1)
    keys += [] if version in ("0.5.6", "0.5.10.post1") else ["cached_tokens_details"]
    keys += [] if old else ["dp_rank"]
    return [*keys, "e2e_latency", "response_sent_to_client_ts"]


@pytest.mark.parametrize("version", [*VERSIONS, "0.5.10.post1"])
def test_meta_info_and_logprobs_per_version(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version)
    spans = version in ("0.5.21", "0.5.23")
    plain = _generate(emu, {"text": PROMPT, "sampling_params": {"max_new_tokens": 5}})
    assert list(plain["meta_info"]) == _keys(version, logprob=False, top=False, ids=False, spans=spans)
    out = _generate(
        emu,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 3},
            "return_logprob": True,
            "top_logprobs_num": 4,
            "token_ids_logprob": [7, 11],
        },
    )
    meta = out["meta_info"]
    assert list(meta) == _keys(version, logprob=True, top=True, ids=True, spans=spans)
    ids = out["output_ids"]
    assert len(ids) == meta["completion_tokens"] == 6 and meta["finish_reason"] == {
        "type": "length",
        "length": 6,
    }
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    for (lp, tok, text), top, by_id in zip(
        meta["output_token_logprobs"],
        meta["output_top_logprobs"],
        meta["output_token_ids_logprobs"],
        strict=True,
    ):
        assert lp <= 0 and text is None
        values = [e[0] for e in top]
        assert len(top) == 4 and values == sorted(values, reverse=True)
        if tok in [e[1] for e in top]:  # the sampled token's logprob is its entry in the top list
            assert lp == pytest.approx(next(e[0] for e in top if e[1] == tok))
        else:
            assert lp <= values[-1]
        assert [e[1] for e in by_id] == [7, 11] and all(e[0] <= 0 for e in by_id)
    # logprob_start_len -1: the last prompt token (None) on 0.5.6, no input logprobs from 0.5.15
    expected: list[Any] = [[None, meta["input_token_logprobs"][0][1], None]] if version == "0.5.6" else []
    assert meta["input_token_logprobs"] == expected
    assert meta["input_top_logprobs"] == ([None] if version == "0.5.6" else [])


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_input_logprobs_from_logprob_start_len(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version)
    words = PROMPT.split()
    out = _generate(
        emu,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 2,
            "return_text_in_logprobs": True,
        },
    )
    inp = out["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(words) - 2 and inp[0][0] is None
    assert all(lp < 0 for lp, _, _ in inp[1:]) and all(text.startswith("t") for _, _, text in inp)
    # a start past the prompt: the scheduler aborts the request with 400 (0.5.6 also at == len)
    at_len = emu.call(
        "POST", "/generate", {"text": PROMPT, "return_logprob": True, "logprob_start_len": len(words)}
    )
    assert at_len.status == (400 if version == "0.5.6" else 200)
    past = emu.call("POST", "/generate", {"text": PROMPT, "return_logprob": True, "logprob_start_len": 99})
    assert past.status == 400 and "Please use a smaller logprob_start_len" in past.body["error"]["message"]


def test_tokens_and_logprobs_are_reproducible_per_seed(start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator()

    def ask(seed: int, temperature: float = 1.0) -> Any:
        params = {"max_new_tokens": 8, "temperature": temperature, "sampling_seed": seed}
        return _generate(
            emu, {"text": PROMPT, "sampling_params": params, "return_logprob": True, "top_logprobs_num": 1}
        )

    a, b, c = ask(1), ask(1), ask(2)
    assert a["output_ids"] == b["output_ids"] and a["output_ids"] != c["output_ids"]
    assert b["meta_info"]["cached_tokens"] == len(PROMPT.split()) - 1  # the last token is never matched
    strip = ("id", "e2e_latency", "response_sent_to_client_ts", "cached_tokens", "cached_tokens_details")
    assert {k: v for k, v in a["meta_info"].items() if k not in strip} == {
        k: v for k, v in b["meta_info"].items() if k not in strip
    }
    greedy = ask(1, 0.0)
    assert greedy["output_ids"] == ask(9, 0.0)["output_ids"]  # greedy ignores the seed
    for (lp, tok, _), top in zip(
        greedy["meta_info"]["output_token_logprobs"], greedy["meta_info"]["output_top_logprobs"], strict=True
    ):
        assert [tok, lp] == [top[0][1], top[0][0]]  # the argmax, at temperature 1


def _events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_stream_is_cumulative_and_ends_with_done(
    version: str, start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator(version, tps=200)
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "sampling_seed": 4},
        "return_logprob": True,
    }
    whole = _generate(emu, body)
    r = emu.call("POST", "/generate", {**body, "stream": True})
    assert r.status == 200
    chunks = _events(r.text)
    assert len(chunks) == 5
    for n, chunk in enumerate(chunks, start=1):
        assert len(chunk["output_ids"]) == n and len(chunk["meta_info"]["output_token_logprobs"]) == n
        assert chunk["meta_info"]["finish_reason"] == (None if n < 5 else {"type": "length", "length": 5})
        assert ("e2e_latency" in chunk["meta_info"]) == (n == 5)
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert "response_sent_to_client_ts" not in chunks[1]["meta_info"]
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    bad = emu.call("POST", "/generate", {**body, "stream": True, "logprob_start_len": 99})
    (error,) = _events(bad.text)
    assert "Please use a smaller logprob_start_len" in error["error"]["message"]
    assert ("type" in error["error"]) == (version != "0.5.6")


def test_stream_batch_chunks_carry_their_index(start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(tps=200)
    r = emu.call(
        "POST",
        "/generate",
        {"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 3}, "stream": True},
    )
    chunks = _events(r.text)
    assert sorted(c["index"] for c in chunks) == [0, 0, 0, 1, 1, 1]


def test_parallel_samples_share_the_cached_prefix(start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator()
    out = _generate(emu, {"text": [PROMPT, "other prompt"], "sampling_params": {"max_new_tokens": 4, "n": 3}})
    assert len(out) == 6 and len({o["meta_info"]["id"] for o in out}) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(PROMPT.split())] * 3 + [2] * 3
    assert len({tuple(o["output_ids"]) for o in out[:3]}) == 3  # the samples differ
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in out)  # the prefix warmup ran first


def test_stop_token_and_stop_string_end_the_request(start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator()
    base = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    ids = _generate(emu, base)["output_ids"]
    by_token = _generate(
        emu, {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [ids[2]]}}
    )
    assert by_token["output_ids"] == ids[:3] and by_token["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": ids[2],
    }
    assert by_token["text"] == " ".join(f"t{t}" for t in ids[:2])  # the stop token is trimmed from the text
    stop = f"t{ids[3]}"
    by_str = _generate(emu, {**base, "sampling_params": {**base["sampling_params"], "stop": [stop]}})
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_str["output_ids"] == ids[:4] and stop not in by_str["text"]


def test_errors_as_sglang_answers_them(start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator("0.5.21")
    hidden = emu.call("POST", "/generate", {"text": "a", "return_hidden_states": True})
    assert (
        hidden.status == 400 and "not configured to return hidden states" in hidden.body["error"]["message"]
    )
    oov = emu.call("POST", "/generate", {"text": "a", "return_logprob": True, "token_ids_logprob": [10**9]})
    assert oov.status == 400 and "out-of-vocabulary" in oov.body["error"]["message"]
    rids = emu.call("POST", "/generate", {"text": ["a", "b"], "rid": ["only-one"]})
    assert rids.status == 400 and "rids length mismatch" in rids.body["error"]["message"]


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_trainer_rollout_computes_its_loss_from_the_logprobs(
    version: str, start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator(version, "--weight-version", "0")
    emu.wait_ready()
    args = argparse.Namespace(
        samples_per_prompt=3, max_new_tokens=6, prompts=4, prefix_tokens=8, concurrency=2, request_timeout=30
    )
    stats = Rollout(emu.url, None, args).run(1, "0")
    assert stats["responses"] == stats["scored"] == 12
    assert stats["loss"] is not None and math.isfinite(stats["loss"]) and stats["logprob_mean"] < 0
    assert 0.0 <= stats["reward"] <= 1.0


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_openai_completions_logprobs_and_usage(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version)
    body = {
        "model": "m",
        "prompt": ["a b c", "d e"],
        "max_tokens": 3,
        "n": 2,
        "logprobs": 2,
        "temperature": 0.5,
    }
    r = emu.call("POST", "/v1/completions", body)
    assert r.status == 200, r.text
    out = r.body
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and out["object"] == "text_completion"
    assert out["usage"]["prompt_tokens"] == 3 + 2 and out["usage"]["completion_tokens"] == 12
    assert ("completion_tokens_details" in out["usage"]) == (version == "0.5.23")
    assert out["metadata"]["weight_version"] == "default"
    assert ("weight_versions" in out["metadata"]) == (version == "0.5.23")  # spans from 0.5.20
    for c in out["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
        assert lp["text_offset"] == [-1, -1, -1] and all(v <= 0 for v in lp["token_logprobs"])
        assert " ".join(lp["tokens"]) == c["text"] and all(len(t) == 2 for t in lp["top_logprobs"])
        assert c["finish_reason"] == "length" and c["matched_stop"] is None
    zero = emu.call("POST", "/v1/completions", {**body, "logprobs": 0})  # no top lists in meta_info
    assert zero.status == (500 if version == "0.5.6" else 200), zero.text


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_openai_chat_logprobs(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "what is two plus two"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = emu.call("POST", "/v1/chat/completions", body)
    assert r.status == 200, r.text
    (choice,) = r.body["choices"]
    assert ("tool_calls" in choice["message"]) == (version != "0.5.23")
    content = choice["logprobs"]["content"]
    assert " ".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        assert t["bytes"] == list(t["token"].encode()) and t["logprob"] <= 0 and len(t["top_logprobs"]) == 3
    assert r.body["usage"]["completion_tokens"] == 4
    assert (
        emu.call("POST", "/v1/chat/completions", {**body, "logprobs": False}).body["choices"][0]["logprobs"]
        is None
    )


@pytest.mark.parametrize(
    ("version", "reason"), [("0.5.6", "length"), ("0.5.15.post1", "length"), ("0.5.23", "stop")]
)
def test_stop_token_on_the_last_allowed_token(
    version: str, reason: str, start_emulator: Callable[..., Emulator]
) -> None:
    """check_finished tests the length limit first up to 0.5.15, stops first from 0.5.20."""
    emu = start_emulator(version)
    base = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    ids = _generate(emu, base)["output_ids"]
    out = _generate(emu, {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [ids[2]]}})
    assert out["output_ids"] == ids and out["meta_info"]["finish_reason"]["type"] == reason


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_openai_completions_stream(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version, tps=200)
    body = {"model": "m", "prompt": "a b c", "max_tokens": 4, "logprobs": 1, "seed": 5, "temperature": 0}
    whole = emu.call("POST", "/v1/completions", body).body["choices"][0]
    r = emu.call(
        "POST", "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, usage = _events(r.text)
    assert [c["object"] for c in chunks] == ["text_completion"] * 4 and all(
        c["usage"] is None for c in chunks
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [
        [t] for t in whole["logprobs"]["tokens"]
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 7,
        "completion_tokens": 4,
        "reasoning_tokens": 0,
    }
    # echo: 0.5.6 counts the echoed prompt into the stream offset, so later deltas lose text
    echoed = _events(emu.call("POST", "/v1/completions", {**body, "stream": True, "echo": True}).text)
    joined = "".join(c["choices"][0]["text"] for c in echoed)
    assert (joined == "a b c" + whole["text"]) == (version != "0.5.6")
