"""`/generate`: request forms (text or ids, single or batch, `n` samples, per-item logprob options), the
reply's text / output_ids / meta_info as each version builds it, logprobs, and the streamed chunks
(rows C-GEN-* of docs/sglang-conformance.md)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob.emulator import fatal, tokens
from rljob.emulator.bodies import GenerateBody
from rljob.emulator.engine import Engine
from rljob.emulator.scheduler import GenRequest

Logprob = tuple[float | None, int, str | None]


class GenerateError(ValueError):
    pass


@dataclass(frozen=True)
class Item:
    """One request after GenerateReqInput's normalization: a prompt, one sample of it, its options."""

    prompt: list[int]
    rid: str
    max_new_tokens: int
    sampler: tokens.Sampler
    no_stop_trim: bool
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    return_text: bool
    parallel: bool  # one of n > 1 samples of its prompt


def _prompts(body: GenerateBody) -> tuple[list[list[int]], bool]:
    """Token ids per prompt and whether the request was a batch."""
    if body.text is not None:
        if isinstance(body.text, str):
            return [tokens.encode(body.text)], False
        return [tokens.encode(t) for t in body.text], True
    if body.input_ids is not None:
        ids = body.input_ids
        if not ids:
            raise GenerateError("input_ids cannot be empty.")
        if isinstance(ids[0], list):
            return [list(x) for x in ids if isinstance(x, list)], True
        return [[x for x in ids if isinstance(x, int)]], False
    raise GenerateError("Either text, input_ids or input_embeds should be provided.")


def _per_item(value: Any, i: int, n_samples: int, name: str) -> Any:
    """A batch field: one value for all, or a list with one per prompt (not allowed with n > 1)."""
    if not isinstance(value, list):
        return value
    if n_samples > 1:
        raise GenerateError(f"Cannot use list {name} with parallel_sample_num > 1")
    return value[i]


def _sampling(
    params: dict[str, Any], seed: int, sample: int, order: tuple[str, ...]
) -> tuple[tokens.Sampler, int, bool]:
    max_new = params.get("max_new_tokens")
    max_new = 128 if max_new is None else int(max_new)
    if max_new < 0:
        raise GenerateError(f"max_new_tokens must be at least 0, got {max_new}.")
    temperature = params.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature < 0:
        raise GenerateError(f"temperature must be non-negative, got {temperature}.")
    top_p = float(params["top_p"]) if params.get("top_p") is not None else 1.0
    if not 0.0 < top_p <= 1.0:
        raise GenerateError(f"top_p must be in (0, 1], got {top_p}.")
    min_p = float(params.get("min_p") or 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise GenerateError(f"min_p must be in [0, 1], got {min_p}.")
    top_k = int(params["top_k"]) if params.get("top_k") is not None else -1
    if top_k < 1 and top_k != -1:
        raise GenerateError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    stop = params.get("stop") or ()
    sp = tokens.SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=int(params["sampling_seed"]) if params.get("sampling_seed") is not None else seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=frozenset(int(t) for t in params.get("stop_token_ids") or () if t is not None),
        ignore_eos=bool(params.get("ignore_eos") or False),
    )
    return tokens.Sampler(sp, sample, order), max_new, bool(params.get("no_stop_trim") or False)


def normalize(
    body: GenerateBody, *, default_seed: int = 0, stop_order: tuple[str, ...] = ("str", "token", "length")
) -> tuple[list[Item], bool]:
    """The sub-requests, prompt-major with each prompt's n samples together (tokenizer_manager's
    `_handle_batch_request`), and whether the reply is a list."""
    prompts, batch = _prompts(body)
    sp = body.sampling_params
    params_list = sp if isinstance(sp, list) else None
    first: dict[str, Any] = (params_list[0] if params_list else None) or (sp if isinstance(sp, dict) else {})
    n = int(first.get("n") or 1)
    if n < 1:
        raise GenerateError(f"n must be at least 1, got {n}.")
    if params_list is not None and any(int(p.get("n") or 1) != n for p in params_list):
        raise GenerateError("The parallel_sample_num should be the same for all samples in sample params.")
    if isinstance(body.rid, list) and len(body.rid) != len(prompts):
        raise GenerateError("The specified rids length mismatch with the batch_size for batch processing.")
    items: list[Item] = []
    for i, prompt in enumerate(prompts):
        params = params_list[i] if params_list is not None else first
        for _ in range(n):
            if n > 1:
                rid = uuid.uuid4().hex  # each sample gets a fresh rid (regenerate_rid)
            elif isinstance(body.rid, list):
                rid = body.rid[i]
            elif body.rid is not None:
                rid = f"{body.rid}_{i}" if batch else body.rid
            else:
                rid = uuid.uuid4().hex
            sampler, max_new, no_stop_trim = _sampling(params, default_seed, len(items), stop_order)
            start = _per_item(body.logprob_start_len, i, n, "logprob_start_len")
            token_ids: Any = body.token_ids_logprob  # a flat list is every item's (_normalize_logprob_params)
            if token_ids and isinstance(token_ids[0], list):
                token_ids = _per_item(token_ids, i, n, "token_ids_logprob")
            items.append(
                Item(
                    prompt=prompt,
                    rid=rid,
                    max_new_tokens=max_new,
                    sampler=sampler,
                    no_stop_trim=no_stop_trim,
                    return_logprob=bool(_per_item(body.return_logprob, i, n, "return_logprob") or False),
                    logprob_start_len=-1 if start is None else int(start),
                    top_logprobs_num=int(_per_item(body.top_logprobs_num, i, n, "top_logprobs_num") or 0),
                    token_ids_logprob=token_ids or None,
                    return_text=body.return_text_in_logprobs,
                    parallel=n > 1,
                )
            )
    return items, batch or n > 1


# --- logprobs (C-GEN-LOGPROB-*) -------------------------------------------------------------------


def resolved_start(item: Item, *, new_default: bool) -> int:
    """Where input logprobs start: `logprob_start_len` -1 means the last prompt token on 0.5.6 (one
    entry, None) and no input logprobs from 0.5.15."""
    if item.logprob_start_len >= 0:
        return item.logprob_start_len
    return len(item.prompt) if new_default else len(item.prompt) - 1


def start_error(item: Item, start: int, *, new_default: bool) -> str | None:
    too_far = start > len(item.prompt) if new_default else start >= len(item.prompt)
    if not too_far:
        return None
    return (
        f"req.logprob_start_len={start} is higher than the number of input tokens "
        f"len(req.origin_input_ids)={len(item.prompt)}. Please use a smaller logprob_start_len."
    )


def _entry(logprob: float | None, token: int, text: bool) -> Logprob:
    return (logprob, token, tokens.token_text(token) if text else None)


def _top(dist: tokens.Distribution, item: Item, temperature: float) -> list[Logprob]:
    return [_entry(lp, t, item.return_text) for lp, t in dist.top(item.top_logprobs_num, temperature)]


def _ids(dist: tokens.Distribution, item: Item, temperature: float) -> list[Logprob] | None:
    ids = item.token_ids_logprob or []
    out = [_entry(dist.logprob(t, temperature), t, item.return_text) for t in ids]
    return out or None  # detokenize_top_logprobs_tokens: an empty position is None


def input_logprobs(item: Item, weights_id: str, start: int) -> dict[str, list[Any]]:
    """The prompt positions from `start`: the first entry is None (its logits are not computed), then
    log P(prompt[j] | prompt[:j]) at temperature 1."""
    out: dict[str, list[Any]] = {"token": [], "top": [], "ids": []}
    for j in range(start, len(item.prompt)):
        tok = item.prompt[j]
        if j == start:
            out["token"].append(_entry(None, tok, item.return_text))
            out["top"].append(None)
            out["ids"].append(None)
            continue
        dist = tokens.distribution(weights_id, item.prompt[:j])
        out["token"].append(_entry(dist.logprob(tok), tok, item.return_text))
        out["top"].append(_top(dist, item, 1.0))
        out["ids"].append(_ids(dist, item, 1.0))
    return out


def output_logprobs(item: Item, output: Sequence[int], weights_ids: Sequence[str]) -> dict[str, list[Any]]:
    """Per output token: its logprob, the top list and the requested ids, all under the distribution
    the token was drawn from, at the request's logprob temperature."""
    temperature = item.sampler.params.logprob_temperature
    out: dict[str, list[Any]] = {"token": [], "top": [], "ids": []}
    for i, tok in enumerate(output):
        dist = tokens.distribution(weights_ids[i], [*item.prompt, *output[:i]])
        out["token"].append(_entry(dist.logprob(tok, temperature), tok, item.return_text))
        out["top"].append(_top(dist, item, temperature))
        out["ids"].append(_ids(dist, item, temperature))
    return out


# --- replies --------------------------------------------------------------------------------------


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


@dataclass
class Generation:
    """One sub-request in flight: its item and, once started, the scheduler's request."""

    item: Item
    index: int
    created: float
    input_weights: str  # the weights loaded when it started: they score the prompt
    req: GenRequest | None = None
    sent: float = 0.0  # time.time() of the first reply: response_sent_to_client_ts is written once
    dispatched: float = field(default_factory=time.monotonic)  # sent to the scheduler


def _logprob_fields(
    engine: Engine, g: Generation, output: list[int], weights_ids: list[str]
) -> dict[str, Any]:
    item, new = g.item, _new_layout(engine)
    start = resolved_start(item, new_default=new)
    # the prompt is scored by the weights that drew the first token, else those loaded at the start
    inp = input_logprobs(item, weights_ids[0] if weights_ids else g.input_weights, start)
    out = output_logprobs(item, output, weights_ids)
    fields: dict[str, Any] = {"input_token_logprobs": inp["token"], "output_token_logprobs": out["token"]}
    if new:
        fields["output_token_logprobs_length"] = len(out["token"])
    if item.top_logprobs_num > 0:
        fields["input_top_logprobs"] = inp["top"]
        fields["output_top_logprobs"] = out["top"]
    if item.token_ids_logprob is not None:
        fields["input_token_ids_logprobs"] = inp["ids"]
        fields["output_token_ids_logprobs"] = out["ids"]
    return fields


def _new_layout(engine: Engine) -> bool:
    """0.5.10.post1 on: reasoning_tokens, dp_rank, output_token_logprobs_length, and logprob_start_len -1
    means no input logprobs (C-GEN-META, C-GEN-LOGPROB-START, C-GEN-LOGPROB-SHAPE)."""
    return engine.profile.key >= (0, 5, 10)


def _retractions_key(engine: Engine) -> str:
    """`total_retractions` up to 0.5.10.post1, `num_retractions` from 0.5.15.post1 (C-GEN-META)."""
    return "num_retractions" if engine.profile.key >= (0, 5, 15) else "total_retractions"


def reply(engine: Engine, g: Generation, *, finished: bool) -> dict[str, Any]:
    """One chunk (streaming) or the whole reply: text, output_ids and meta_info, cumulative."""
    req, item, new = g.req, g.item, _new_layout(engine)
    assert req is not None
    output, versions, weights_ids = list(req.output), list(req.versions), list(req.weights_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if finished else None,
        "prompt_tokens": len(req.prompt),
        "weight_version": versions[-1] if versions else engine.weight_version,
        _retractions_key(engine): req.retractions,
    }
    if engine.profile.meta_request_timestamps and engine.cfg.enable_metrics:
        meta.update(_scheduler_time_stats(engine, req))
    if item.return_logprob:
        meta.update(_logprob_fields(engine, g, output, weights_ids))
    if new:
        meta["reasoning_tokens"] = 0
    # the prefix match leaves the last prompt token, and stops at logprob_start_len (C-GEN-CACHED)
    cached = min(req.cached_tokens, max(0, len(req.prompt) - 1))
    if item.return_logprob and item.logprob_start_len >= 0:
        cached = min(cached, item.logprob_start_len)
    meta.update(completion_tokens=len(output), cached_tokens=cached)
    if engine.profile.has_weight_versions_spans and versions:
        meta["weight_versions"] = _spans(versions)
    if engine.profile.meta_cached_tokens_details:
        # get_cached_tokens_details: the radix cache is all device memory here (no HiCache), so
        # {"device": cached_tokens, "host": 0}, or None with no hit (output_streamer.py:60-88@0.5.15.post1)
        meta["cached_tokens_details"] = {"device": cached, "host": 0} if cached > 0 else None
    if new:
        meta["dp_rank"] = req.dp_rank if len(engine.ranks) > 1 else None
    if finished:
        now = time.monotonic()
        meta["e2e_latency"] = now - g.created
        if engine.profile.meta_request_timestamps and engine.cfg.enable_metrics:
            meta.update(_request_time_stats(engine, g, req, now, len(output)))
    if not g.sent:
        g.sent = time.time()
        meta["response_sent_to_client_ts"] = g.sent
    return {"text": _text(req, item, finished), "output_ids": output, "meta_info": meta}


def _realtime(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


def _scheduler_time_stats(engine: Engine, req: GenRequest) -> dict[str, Any]:
    """SchedulerReqTimeStats.convert_to_output_meta_info as the tokenizer receives it (C-GEN-META;
    `VersionProfile.meta_scheduler_timestamps`, `meta_storage_waits`)."""
    profile = engine.profile
    if not profile.meta_scheduler_timestamps:
        return {"queue_time": 0.0}  # req_time_stats.py:629-640,1030-1031,1150-1167@0.5.15.post1
    out: dict[str, Any] = {}
    if profile.meta_storage_waits:
        out.update(storage_prefetch_wait=0.0, storage_staging_wait=0.0)
    if req.forward_at:
        out["forward_entry_time"] = _realtime(req.forward_at)
    if req.prefill_done_at:
        out["prefill_finished_time"] = _realtime(req.prefill_done_at)
    out["queue_time"] = req.forward_at - req.started if req.forward_at else 0.0
    return out


def _request_time_stats(
    engine: Engine, g: Generation, req: GenRequest, now: float, completion_tokens: int
) -> dict[str, Any]:
    """APIServerReqTimeStats.convert_to_output_meta_info on the last answer (req_time_stats.py:471-495
    @0.5.15.post1, req_time_stats.py:494-520@0.5.21, req_time_stats.py:500-530@0.5.23): the first token
    time is when the tokenizer got it, the decode latency runs from there to the finish."""
    out: dict[str, Any] = {"request_received_ts": _realtime(g.created)}
    first_token = req.prefill_done_at
    if engine.profile.meta_first_token_latency and first_token > g.created:
        out["first_token_latency"] = first_token - g.created
    out["api_server_dispatch_finish_ts"] = _realtime(g.dispatched)
    if g.sent:  # a stream whose first chunk went out already
        out["response_sent_to_client_ts"] = g.sent
    out["request_finished_ts"] = _realtime(now)
    decode_latency = now - first_token if first_token else 0.0
    if decode_latency > 0.0 and completion_tokens > 1:
        out["decode_throughput"] = (completion_tokens - 1) / decode_latency
    return out


def _text(req: GenRequest, item: Item, finished: bool) -> str:
    """The detokenized output; a matched stop token or stop string is trimmed (unless no_stop_trim)."""
    ids = req.output
    matched = (req.finish_reason or {}).get("matched") if finished and not item.no_stop_trim else None
    if isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = tokens.decode(ids, garbage=req.garbage)
    if isinstance(matched, str) and (pos := text.find(matched)) != -1:
        text = text[:pos]
    return text


# --- running ------------------------------------------------------------------------------------


def _dp_rank(engine: Engine, body: GenerateBody) -> int | None:
    # data_parallel_rank (io_struct.py:204@0.5.6), renamed routed_dp_rank (io_struct.py:298-303@0.5.23)
    dp_rank = body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank
    if dp_rank is not None and not 0 <= dp_rank < len(engine.ranks):
        raise GenerateError(f"data_parallel_rank {dp_rank} is out of range [0, {len(engine.ranks)})")
    return dp_rank


def _stop_order(engine: Engine) -> tuple[str, ...]:
    """check_finished's order of the length limit, stop tokens (EOS included) and stop strings."""
    if engine.profile.key < (0, 5, 15):
        return ("length", "token", "str")
    if engine.profile.key < (0, 5, 20):
        return ("length", "str", "token")
    return ("str", "token", "length")


def _hidden_states_error(engine: Engine) -> str:
    """No hidden-states flag is emulated, so the server never returns them (C-GEN-HIDDEN)."""
    if engine.profile.key >= (0, 5, 20):
        return (
            "The server is not configured to return hidden states. Please set `--return-hidden-states-mode "
            "last`, `--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
        )
    return (
        "The server is not configured to return the hidden states. "
        "Please set `--enable-return-hidden-states` to enable this feature."
    )


def _prepare(engine: Engine, body: GenerateBody) -> tuple[list[Item], bool, int | None]:
    items, batch = normalize(body, stop_order=_stop_order(engine))
    dp_rank = _dp_rank(engine, body)
    new = _new_layout(engine)
    hidden = body.return_hidden_states
    if any(hidden) if isinstance(hidden, list) else hidden:
        raise GenerateError(_hidden_states_error(engine))
    for item in items:  # C-GEN-VOCAB: no range check; the embedding's device-side assert ends the scheduler
        if any(t >= tokens.VOCAB for t in item.prompt):
            fatal.scheduler_exception(
                "torch.AcceleratorError", "CUDA error: device-side assert triggered (input id >= vocab size)"
            )
    checks_ids = engine.profile.key >= (0, 5, 15)  # the token_ids_logprob range check (C-GEN-REFUSALS)
    for item in items:
        for t in item.token_ids_logprob or [] if checks_ids else []:
            if not 0 <= t < tokens.VOCAB:
                raise GenerateError(
                    f"token_ids_logprob contains out-of-vocabulary token id {t}; "
                    f"valid range is [0, {tokens.VOCAB})."
                )
    for item in items:  # the scheduler aborts such a request with 400 (C-GEN-LOGPROB-START)
        start = resolved_start(item, new_default=new)
        if item.return_logprob and (err := start_error(item, start, new_default=new)):
            raise GenerateError(err)
    return items, batch, dp_rank


async def _run(
    engine: Engine,
    items: list[Item],
    dp_rank: int | None,
    on_token: Callable[[Generation], None] | None = None,
    on_done: Callable[[Generation], None] | None = None,
) -> list[Generation]:
    """Every item through the scheduler; with n > 1 each prompt first runs once with max_new_tokens 0 to
    cache its prefix (C-GEN-N)."""
    if any(i.parallel for i in items):
        for prompt in _unique([i.prompt for i in items]):
            await engine.dispatch(dp_rank).generate(prompt, 0, tokens.Sampler(), None)
    gens = [Generation(item, i, time.monotonic(), engine.weights.id) for i, item in enumerate(items)]

    async def one(g: Generation) -> None:
        def emitted(req: GenRequest) -> None:
            g.req = req
            if on_token is not None:
                on_token(g)

        g.req = await engine.dispatch(dp_rank).generate(
            g.item.prompt, g.item.max_new_tokens, g.item.sampler, g.item.rid, on_token=emitted
        )
        if on_done is not None:
            on_done(g)

    await asyncio.gather(*(one(g) for g in gens))
    return gens


def _unique(prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for p in prompts:
        if p not in out:
            out.append(p)
    return out


async def generate(engine: Engine, body: GenerateBody) -> dict[str, Any] | list[dict[str, Any]]:
    items, batch, dp_rank = _prepare(engine, body)
    async with engine.tokenizer.reader():
        gens = await _run(engine, items, dp_rank)
    replies = [reply(engine, g, finished=True) for g in gens]
    return replies if batch else replies[0]


async def generate_stream(engine: Engine, body: GenerateBody) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a `stream: true` request: one per emitted token, each cumulative (text, output_ids
    and logprobs so far), the last with finish_reason; a batch's chunks carry `index` (C-GEN-STREAM)."""
    items, batch, dp_rank = _prepare(engine, body)
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def chunk(g: Generation, *, finished: bool) -> None:
        out = reply(engine, g, finished=finished)
        if batch:
            out["index"] = g.index
        queue.put_nowait(out)

    def emitted(g: Generation) -> None:
        assert g.req is not None
        if len(g.req.output) < g.req.max_new_tokens:  # the last token comes with the finished chunk
            chunk(g, finished=False)

    async def run() -> None:
        try:
            await _run(engine, items, dp_rank, emitted, lambda g: chunk(g, finished=True))
        finally:
            queue.put_nowait(None)

    async with engine.tokenizer.reader():
        task = asyncio.ensure_future(run())
        try:
            while (out := await queue.get()) is not None:
                yield out
            await task
        finally:
            task.cancel()


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def stream_error(engine: Engine, message: str) -> dict[str, Any]:
    """The event a streamed request's ValueError becomes (C-GEN-STREAM)."""
    if engine.profile.key >= (0, 5, 15):
        return {
            "error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        }
    return {"error": {"message": message}}
