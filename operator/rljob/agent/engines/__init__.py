"""The registry of the engines the agent drives, one folder each (agent/engines/<name>/: its client,
quirks, guards and framework endpoint), behind the verbs of agent/engines/base.py. The only module outside
the engines' folders that names them."""

from __future__ import annotations

from collections.abc import Mapping

from rljob.agent.engines.base import EngineGuards
from rljob.agent.engines.sglang.guards import SGLangGuards
from rljob.api.spec import EngineKind

GUARDS: Mapping[EngineKind, EngineGuards] = {EngineKind.SGLANG: SGLangGuards()}


def guards(kind: EngineKind) -> EngineGuards:
    """The guards of the engine `kind` (its facts' kind)."""
    return GUARDS[kind]
