"""The registry of the engines the agent drives, one folder each (agent/engines/<name>/: its client,
quirks, guards and framework endpoint), behind the verbs of agent/engines/base.py. The only agent module
outside the engines' folders that names them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rljob.agent.engines.base import Engine, EngineGuards
from rljob.agent.engines.sglang.engine import SGLangEngine
from rljob.agent.engines.vllm.engine import VLLMEngine
from rljob.api.spec import EngineKind, RefitSource


@dataclass(frozen=True)
class EngineLink:
    """How the agent reaches the engine in its pod."""

    url: str  # its HTTP API, on the pod's loopback
    api_key: str | None  # the key its normal routes take, if it runs with one
    admin_api_key: str | None  # the key its lifecycle routes take, if it runs with one
    call_timeout_s: float  # the bound on a call made outside a command's deadline
    observe: Callable[[str, float], None]  # each call's latency, by operation
    hang_probe_timeout_s: float = 5.0  # where the engine needs a hang check (Engine.hang_check)
    refit_source: RefitSource | None = None  # the RLJob's, where the operator passed it (launch refusals)
    keep_released_weights: bool = False  # where a release chooses, keep the weights on the host


ENGINES: Mapping[EngineKind, Callable[[EngineLink], Engine]] = {
    EngineKind.SGLANG: lambda link: SGLangEngine.build(
        link.url,
        api_key=link.api_key,
        admin_api_key=link.admin_api_key,
        call_timeout_s=link.call_timeout_s,
        observe=link.observe,
        hang_probe_timeout_s=link.hang_probe_timeout_s,
    ),
    EngineKind.VLLM: lambda link: VLLMEngine.build(
        link.url,
        api_key=link.api_key,
        call_timeout_s=link.call_timeout_s,
        observe=link.observe,
        refit_source=link.refit_source,
        keep_weights=link.keep_released_weights,
    ),
}
GUARDS: Mapping[EngineKind, EngineGuards] = {
    EngineKind.SGLANG: SGLangEngine.guards,
    EngineKind.VLLM: VLLMEngine.guards,
}


def build_engine(kind: EngineKind, link: EngineLink) -> Engine:
    """The engine `kind`, reached through `link`; not started (Engine.start)."""
    return ENGINES[kind](link)


def guards(kind: EngineKind) -> EngineGuards:
    """The guards of the engine `kind` (its facts' kind)."""
    return GUARDS[kind]
