"""`/generate`: request forms (text or ids, single or batch, `n` samples) and the reply's meta_info
(weight_version, per-token weight_versions spans on ≥0.5.19, cached tokens)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rljob.emulator import tokens
from rljob.emulator.bodies import GenerateBody
from rljob.emulator.engine import Engine
from rljob.emulator.scheduler import GenRequest


class GenerateError(ValueError):
    pass


def _prompts(body: GenerateBody) -> tuple[list[list[int]], bool]:
    """Token ids per prompt and whether the request was a batch."""
    if body.text is not None:
        if isinstance(body.text, str):
            return [tokens.encode(body.text)], False
        return [tokens.encode(t) for t in body.text], True
    if body.input_ids is not None:
        ids = body.input_ids
        if ids and isinstance(ids[0], list):
            return [list(x) for x in ids if isinstance(x, list)], True
        return [[x for x in ids if isinstance(x, int)]], False
    raise GenerateError("Either text or input_ids should be provided.")


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def _reply(engine: Engine, req: GenRequest, latency: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt),
        "completion_tokens": len(req.output),
        "cached_tokens": req.cached_tokens,
        "weight_version": req.versions[-1] if req.versions else engine.weight_version,
        "e2e_latency": latency,
    }
    if engine.profile.has_weight_versions_spans and req.versions:
        meta["weight_versions"] = _spans(req.versions)
    return {
        "text": tokens.decode(req.output, garbage=req.garbage),
        "output_ids": req.output,
        "meta_info": meta,
    }


async def generate(engine: Engine, body: GenerateBody) -> dict[str, Any] | list[dict[str, Any]]:
    prompts, batch = _prompts(body)
    params = body.sampling_params or {}
    max_new = int(params.get("max_new_tokens", 128))
    n = int(params.get("n", 1))
    greedy = float(params.get("temperature", 1.0)) == 0.0
    if max_new < 0 or n < 1:
        raise GenerateError("max_new_tokens must be >= 0 and n >= 1")
    jobs = [(p, s) for p in prompts for s in range(n)]
    rids = (
        body.rid if isinstance(body.rid, list) else [body.rid] * len(jobs) if body.rid else [None] * len(jobs)
    )
    if len(rids) != len(jobs):
        raise GenerateError("The number of rids does not match the number of prompts.")
    # data_parallel_rank (io_struct.py:204@0.5.6), renamed routed_dp_rank (io_struct.py:298-303@0.5.23)
    dp_rank = body.routed_dp_rank if body.routed_dp_rank is not None else body.data_parallel_rank
    if dp_rank is not None and not 0 <= dp_rank < len(engine.ranks):
        raise GenerateError(f"data_parallel_rank {dp_rank} is out of range [0, {len(engine.ranks)})")
    started = time.monotonic()
    async with engine.tokenizer.reader():
        done = await asyncio.gather(
            *(
                engine.dispatch(dp_rank).generate(p, max_new, 0 if greedy else i, rid)
                for i, ((p, _), rid) in enumerate(zip(jobs, rids, strict=True))
            )
        )
    latency = time.monotonic() - started
    replies = [_reply(engine, r, latency) for r in done]
    return replies if batch or n > 1 else replies[0]
