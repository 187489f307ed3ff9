"""`/v1/completions` (also streamed) and `/v1/chat/completions`: the fields RL clients read (`choices[].text`
/ `message.content`, `logprobs`, `finish_reason`, `matched_stop`, `usage`), built from the same
sub-requests as `/generate` (rows C-OAI-* of docs/sglang-conformance.md). What cannot be modelled: a chat
template (the emulator joins the messages' contents), tools, reasoning parsers, chat streaming."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from rljob.emulator.bodies import ChatCompletionBody, CompletionBody, GenerateBody
from rljob.emulator.engine import Engine
from rljob.emulator.generation import GenerateError, generate, generate_stream, sse
from rljob.emulator.http_common import engine_of, parse_body

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "no_stop_trim")


def _error(message: str, kind: str = "BadRequestError", status: int = 400) -> web.Response:
    """`create_error_response`: an OpenAI error object (C-OAI-COMPLETIONS)."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


def _sampling_params(
    engine: Engine, body: CompletionBody | ChatCompletionBody, max_new: int | None
) -> dict[str, Any]:
    params: dict[str, Any] = {k: getattr(body, k) for k in _SAMPLING if getattr(body, k) is not None}
    params.update(max_new_tokens=max_new, n=body.n)
    if body.seed is not None and engine.profile.key >= (0, 5, 10):
        params["sampling_seed"] = body.seed  # 0.5.6 ignores `seed`
    return params


def _openai_logprobs(
    tokens_lp: list[Any], tops: list[Any] | None, input_lp: list[Any] | None = None
) -> dict[str, Any]:
    """`to_openai_style_logprobs`: tokens and token_logprobs (input first, then output), text_offset -1,
    top_logprobs as {text: logprob} per position."""
    entries = [*(input_lp or []), *tokens_lp]
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [e[0] for e in entries],
        "tokens": [e[2] for e in entries],
        "top_logprobs": [None if t is None else {e[2]: e[0] for e in t} for t in (tops or [])],
    }


def _usage(engine: Engine, replies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """prompt tokens counted once per prompt, completion tokens over every choice; no cache report."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in replies[::n])
    completion = sum(r["meta_info"]["completion_tokens"] for r in replies)
    return _usage_info(engine, prompt, completion)


def _usage_info(engine: Engine, prompt: int, completion: int) -> dict[str, Any]:
    """UsageInfo with its null fields."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }
    if engine.profile.key >= (0, 5, 23):
        usage["completion_tokens_details"] = None
    return usage


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """The first reply's weight_version, and its spans where /generate has them (0.5.20 on)."""
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def _finish(reply: dict[str, Any]) -> tuple[str | None, Any]:
    reason = reply["meta_info"]["finish_reason"]
    return (reason["type"] if reason else None), (reason.get("matched") if reason else None)


async def _run(engine: Engine, generate_body: dict[str, Any]) -> list[dict[str, Any]]:
    out = await generate(engine, GenerateBody.model_validate(generate_body))
    return out if isinstance(out, list) else [out]


def _completion_request(eng: Engine, body: CompletionBody) -> dict[str, Any]:
    """The GenerateReqInput a completion request becomes."""
    prompt = body.prompt
    kind = "text" if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)) else "input_ids"
    return {
        kind: prompt,
        "sampling_params": _sampling_params(eng, body, body.max_tokens),
        "return_logprob": body.logprobs is not None,
        "top_logprobs_num": body.logprobs or 0,
        "logprob_start_len": 0 if body.echo and body.logprobs else -1,
        "return_text_in_logprobs": True,
        "rid": body.rid,
        "stream": body.stream,
    }


def _echo_text(body: CompletionBody, index: int) -> str:
    prompt = body.prompt
    single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    p: Any = prompt if single else prompt[index // body.n]
    return p if isinstance(p, str) else " ".join(f"t{t}" for t in p)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionBody)
    eng = engine_of(request)
    if body.prompt in ("", []):
        return _error("Prompt cannot be empty")
    if body.stream:
        return await _stream_completions(request, eng, body)
    echo_logprobs = body.echo and bool(body.logprobs)
    try:
        replies = await _run(eng, _completion_request(eng, body))
    except GenerateError as e:
        return _error(str(e))
    if body.logprobs == 0 and eng.profile.key < (0, 5, 10):
        # top_logprobs_num 0 leaves output_top_logprobs out of meta_info, which 0.5.6 indexes: KeyError
        return _error("Internal server error: 'output_top_logprobs'", "InternalServerError", 500)
    choices = []
    for idx, r in enumerate(replies):
        text = r["text"]
        if body.echo:
            text = _echo_text(body, idx) + text
        logprobs = None
        if body.logprobs is not None:
            meta = r["meta_info"]
            logprobs = _openai_logprobs(
                meta.get("output_token_logprobs", []),
                [
                    *(meta.get("input_top_logprobs") or [] if echo_logprobs else []),
                    *meta.get("output_top_logprobs", []),
                ],
                meta["input_token_logprobs"] if echo_logprobs else None,
            )
        reason, matched = _finish(r)
        choices.append(
            {
                "index": idx,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        )
    return web.json_response(
        {
            "id": replies[0]["meta_info"]["id"],
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": _usage(eng, replies, body.n),
            "metadata": _metadata(replies[0]["meta_info"]),
        }
    )


async def _stream_completions(request: web.Request, eng: Engine, body: CompletionBody) -> web.StreamResponse:
    """One `data:` chunk per /generate chunk: the text and logprobs added since the previous one of that
    index, its finish_reason; a usage chunk with `stream_options.include_usage`; then `[DONE]`."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    created = int(time.time())
    offsets: dict[int, int] = {}
    seen_logprobs: dict[int, int] = {}
    prompt_tokens: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    last_id = ""
    options, new = body.stream_options or {}, eng.profile.key >= (0, 5, 15)
    try:
        async for content in generate_stream(
            eng, GenerateBody.model_validate(_completion_request(eng, body))
        ):
            index, meta = int(content.get("index", 0)), content["meta_info"]
            last_id = meta["id"]
            prompt_tokens[index], completion_tokens[index] = meta["prompt_tokens"], meta["completion_tokens"]
            first = index not in offsets
            text = (_echo_text(body, index) if first and body.echo else "") + content["text"]
            logprobs = None
            if body.logprobs is not None:
                echo_lp = first and body.echo and bool(body.logprobs)
                done = seen_logprobs.get(index, 0)
                logprobs = _openai_logprobs(
                    meta.get("output_token_logprobs", [])[done:],
                    [
                        *(meta.get("input_top_logprobs") or [] if echo_lp else []),
                        *meta.get("output_top_logprobs", [])[done:],
                    ],
                    meta["input_token_logprobs"] if echo_lp else None,
                )
                seen_logprobs[index] = len(meta.get("output_token_logprobs", []))
            delta = text[offsets.get(index, 0) :]
            # 0.5.6 counts the echoed prompt into the offset; later versions the generated text only
            offsets[index] = len(content["text"]) if new else offsets.get(index, 0) + len(delta)
            reason, matched = _finish(content)
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
            choice["matched_stop"] = matched
            chunk = {"id": meta["id"], "object": "text_completion", "created": created, "model": body.model}
            usage = None
            if options.get("continuous_usage_stats"):
                usage = _usage_info(eng, meta["prompt_tokens"], meta["completion_tokens"])
            await resp.write(sse({**chunk, "choices": [choice], "usage": usage}))
        if options.get("include_usage"):
            usage = _usage_totals(prompt_tokens, completion_tokens, body.n)
            chunk = {"id": last_id, "object": "text_completion", "created": created, "model": body.model}
            await resp.write(sse({**chunk, "choices": [], "usage": usage}))
    except GenerateError as e:
        error = {"object": "error", "message": str(e), "type": "BadRequestError", "param": None, "code": 400}
        await resp.write(sse({"error": error}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _usage_totals(prompt: dict[int, int], completion: dict[int, int], n: int) -> dict[str, int]:
    """calculate_streaming_usage, its None fields dropped: prompt tokens of each prompt's first choice."""
    p = sum(t for i, t in prompt.items() if i % n == 0)
    c = sum(completion.values())
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "reasoning_tokens": 0}


def _chat_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    """ChoiceLogprobs: per output token its text, UTF-8 bytes, logprob and top list."""
    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, (lp, _, text) in enumerate(meta["output_token_logprobs"]):
        top = tops[i] if i < len(tops) and tops[i] else []
        content.append(
            {
                "token": text,
                "bytes": list(text.encode()),
                "logprob": lp,
                "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": v} for v, _, t in top],
            }
        )
    return {"content": content}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ChatCompletionBody)
    eng = engine_of(request)
    if body.stream:
        return _error("stream=true is not emulated on /v1/chat/completions")
    if not body.messages:
        return _error("Messages cannot be empty.")
    # no chat template: the prompt is the messages' contents in order (C-OAI-CHAT)
    prompt = " ".join(_content(m.get("content")) for m in body.messages)
    max_new = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    try:
        replies = await _run(
            eng,
            {
                "text": prompt,
                "sampling_params": _sampling_params(eng, body, max_new),
                "return_logprob": body.logprobs,
                "top_logprobs_num": body.top_logprobs or 0,
                "logprob_start_len": -1,
                "return_text_in_logprobs": True,
                "rid": body.rid,
            },
        )
    except GenerateError as e:
        return _error(str(e))
    choices = []
    for idx, r in enumerate(replies):
        message: dict[str, Any] = {"role": "assistant", "content": r["text"], "reasoning_content": None}
        if eng.profile.key < (0, 5, 23):
            message["tool_calls"] = None  # from 0.5.23 a None tool_calls is left out
        reason, matched = _finish(r)
        choices.append(
            {
                "index": idx,
                "message": message,
                "logprobs": _chat_logprobs(r["meta_info"]) if body.logprobs else None,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        )
    return web.json_response(
        {
            "id": replies[0]["meta_info"]["id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": _usage(eng, replies, body.n),
            "metadata": _metadata(replies[0]["meta_info"]),
        }
    )


def _content(content: Any) -> str:
    if isinstance(content, list):  # content parts: the text ones
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
