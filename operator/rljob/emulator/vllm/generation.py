"""`/v1/completions` and `/v1/chat/completions` as an RL client reads them: text, token ids, logprobs,
finish and stop reasons, usage, and 0.34's `weight_versions` spans (V-ROUTE-WV), built from the emulator's
token model (rljob.emulator.tokens). A request sent while paused waits in the queue (0.26) or gets 503
(0.34 after an abort/wait pause, V-REQ-PAUSED); an aborted one answers 200 with its partial output and
`finish_reason: "abort"` (V-DRAIN-ABORT); one running when the engine dies gets 500 (V-DEATH-EXC).

Not emulated: streaming (`stream: true` is refused with 400), chat templates (the messages' contents are
joined), tools, beam search, prompt logprobs."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from rljob.emulator import tokens
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.errors import HTTPError, NotFoundError, ValidationFailed
from rljob.emulator.vllm.scheduler import Request


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAIBaseModel logs and ignores unknown fields

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    return_token_ids: bool = False
    return_weight_versions: bool = False  # 0.34 (…/entrypoints/openai/completion/protocol.py:182@0.34.0)
    request_id: str | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def parse(raw: bytes, model: type[_Body]) -> Any:
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise ValidationFailed(errors) from None


def _sampler(body: _Body, sample: int) -> tokens.Sampler:
    stop = body.stop or ()
    params = tokens.SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=-1 if body.top_k in (None, 0) else int(body.top_k),
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        seed=body.seed or 0,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
    )
    return tokens.Sampler(params, sample, ("token", "str", "length"))


def _check(llm: AsyncLLM, body: _Body) -> str:
    if body.stream:
        raise HTTPError(400, "stream=true is not emulated")
    if body.model is not None and body.model not in llm.cfg.served_model_names:
        raise NotFoundError(f"The model `{body.model}` does not exist.")
    return body.model or llm.cfg.served_model_name


def _spans(req: Request) -> list[dict[str, Any]]:
    """WeightVersionSpan per half-open range of output tokens (…/v1/engine/output_processor.py:541-548
    @0.34.0)."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(req.versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _logprobs(req: Request, k: int) -> dict[str, Any]:
    """CompletionLogProbs of the raw model output (logprobs_mode raw_logprobs: temperature 1)."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for i, token in enumerate(req.output):
        dist = tokens.distribution(req.weights_ids[i], req.prompt + req.output[:i])
        text = tokens.token_text(token)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(dist.logprob(token))
        out["tokens"].append(text)
        out["top_logprobs"].append({tokens.token_text(t): lp for lp, t in dist.top(k)} if k else None)
        offset += len(text) + 1
    return out


async def _run(
    llm: AsyncLLM, prompts: list[list[int]], body: _Body, max_tokens: int, ids: list[str]
) -> list[Request]:
    """One engine request per prompt and sample; `ids[i]` is prompt i's (external) request id."""
    reqs = [
        Request(prompt, max_tokens, _sampler(body, s), external_id=ids[i])
        for i, prompt in enumerate(prompts)
        for s in range(max(1, body.n))
    ]
    return list(await asyncio.gather(*(llm.generate(r) for r in reqs)))


def _base_id(body: _Body, header: str | None) -> str:
    """_base_request_id: the X-Request-Id header, else the body's request_id, else a random one
    (…/entrypoints/serve/engine/serving.py:117-126@0.26.0)."""
    return header if header is not None else body.request_id or uuid.uuid4().hex


def _usage(reqs: list[Request], n: int) -> dict[str, Any]:
    prompt = sum(len(r.prompt) for r in reqs[:: max(1, n)])
    completion = sum(len(r.output) for r in reqs)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None}  # fmt: skip


def _with_spans(llm: AsyncLLM, body: _Body, req: Request, choice: dict[str, Any]) -> dict[str, Any]:
    """0.34's choices carry `weight_versions`, filled only when the request asks (V-ROUTE-WV)."""
    if llm.profile.has_weight_version:
        choice["weight_versions"] = _spans(req) if body.return_weight_versions else None
    return choice


def _response(
    kind: str, response_id: str, model: str, choices: list[dict[str, Any]], usage: dict[str, Any], **more: Any
) -> web.Response:
    """The response envelope; `more`: the fields between `usage` and `kv_transfer_params`."""
    return web.json_response(
        {
            "id": response_id,
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            **more,
            "kv_transfer_params": None,
        }
    )


def _prompts(prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokens.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokens.encode(p) if isinstance(p, str) else list(p) for p in prompt]


async def completions(llm: AsyncLLM, raw: bytes, request_id: str | None) -> web.Response:
    body: CompletionBody = parse(raw, CompletionBody)
    model = _check(llm, body)
    prompts = _prompts(body.prompt)
    response_id = f"cmpl-{_base_id(body, request_id)}"  # prompt i runs as f"{response_id}-{i}"
    ids = [f"{response_id}-{i}" for i in range(len(prompts))]
    reqs = await _run(llm, prompts, body, 16 if body.max_tokens is None else body.max_tokens, ids)
    choices = []
    for i, r in enumerate(reqs):
        text = tokens.decode(r.output, garbage=r.garbage)
        if body.echo:
            text = " ".join(tokens.token_text(t) for t in r.prompt) + text
        choice: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": _logprobs(r, body.logprobs) if body.logprobs is not None else None,
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
            "token_ids": list(r.output) if body.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(r.prompt) if body.return_token_ids else None,
        }
        choices.append(_with_spans(llm, body, r, choice))
    return _response("text_completion", response_id, model, choices, _usage(reqs, body.n))


def _content(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


async def chat_completions(llm: AsyncLLM, raw: bytes, request_id: str | None) -> web.Response:
    body: ChatBody = parse(raw, ChatBody)
    model = _check(llm, body)
    prompt = tokens.encode(" ".join(_content(m.get("content")) for m in body.messages))
    max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    response_id = f"chatcmpl-{_base_id(body, request_id)}"
    reqs = await _run(llm, [prompt], body, max_tokens or 16, [response_id])
    choices = []
    for i, r in enumerate(reqs):
        logprobs = None
        if body.logprobs:
            lp = _logprobs(r, body.top_logprobs or 0)
            logprobs = {
                "content": [
                    {
                        "token": t,
                        "logprob": v,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {"token": k, "logprob": x, "bytes": list(k.encode())}
                            for k, x in (top or {}).items()
                        ],
                    }
                    for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
                ]
            }
        text = tokens.decode(r.output, garbage=r.garbage)
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}  # fmt: skip
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": r.finish_reason,
            "stop_reason": r.stop_reason,
            "token_ids": list(r.output) if body.return_token_ids else None,
        }
        choices.append(_with_spans(llm, body, r, choice))
    prompt_ids = list(prompt) if body.return_token_ids else None
    more = {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
    return _response("chat.completion", response_id, model, choices, _usage(reqs, body.n), **more)
