"""Request bodies as SGLang parses them: unknown fields ignored, defaults as in 0.5.23 (C-ROUTE-* rows of
docs/sglang-conformance.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseBody(Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(Body):
    torch_empty_cache: bool = True


class AbortBody(Body):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class MemoryBody(Body):
    tags: list[str] | None = None


class DiskBody(Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    manifest: dict[str, Any] | None = None
    is_async: bool = False
    keep_pause: bool = False
    token_step: int = 0


class TensorBody(Body):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class DistributedBody(Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class InitGroupBody(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class GroupBody(Body):
    group_name: str = "weight_update_group"


class BeginBody(Body):
    selector: Literal["target", "draft", "all"] = "all"


class EmptyBody(Body):
    pass


class WeightVersionBody(Body):
    new_version: str
    abort_all_requests: bool = True


class CheckerBody(Body):
    action: str = "checksum"  # any string: the scheduler refuses what it does not know (C-CHECKER-CHECKSUM)
    allow_quant_error: bool = False
    skip_tensor_list: list[str] = []
    selector: Literal["target", "draft", "all"] = "all"


class GenerateBody(Body):
    """GenerateReqInput's fields that change the reply (C-GEN-REQUEST)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_hidden_states: bool | str | list[bool | str] = False  # "last" / "full" from 0.5.20
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None


class _OpenAISampling(Body):
    """The sampling fields the OpenAI routes pass to /generate (C-OAI-COMPLETIONS, C-OAI-CHAT)."""

    model: str = "default"
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    rid: str | list[str] | None = None


class CompletionBody(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionBody(_OpenAISampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CheckerBody056(Body):
    """0.5.6: `action` is required (io_struct.py:1315-1316@0.5.6)."""

    action: str
