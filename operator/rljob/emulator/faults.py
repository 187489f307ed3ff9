"""Fault injection, set by launch flags and changed at runtime through POST /_emulator/faults."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Faults:
    slow: dict[str, float] = field(default_factory=dict)  # route -> extra seconds before it runs
    hang: set[str] = field(default_factory=set)  # routes that never answer
    release_unmap_delay_s: float = 0.0  # release returns at once, memory is freed this much later
    resume_oom_tags: set[str] = field(default_factory=set)  # resume of these tags OOMs and hangs (#14092)
    refit_fail: bool = False  # refits update weights but answer success:false (0.5.23 flush refusal)
    release_ignore: bool = False  # a follower node acknowledges a release and frees nothing (nodes.py)
    # Refits that answer success and record the version but leave other weights (weight_updater.py):
    refit_noop: bool = False  # the load moves nothing (a transport that reports success: tokenspeed#1373)
    refit_store_as: dict[str, str] = field(default_factory=dict)  # tensor `a` lands in the parameter of `b`
    refit_loads_launch: bool = False  # the engine holds its launch weights after it (miles#1806)

    def update(self, patch: dict[str, Any]) -> None:
        """Replace the given fields; unknown keys are an error so a typo in a test is caught."""
        for key, value in patch.items():
            if key not in self.__dataclass_fields__:
                raise ValueError(f"unknown fault {key!r}")
            current = getattr(self, key)
            if isinstance(current, set):
                value = set(value)
            elif key == "refit_store_as":
                value = {str(k): str(v) for k, v in value.items()}
            elif isinstance(current, dict):
                value = {str(k): float(v) for k, v in value.items()}
            elif isinstance(current, bool):
                value = bool(value)
            else:
                value = float(value)
            setattr(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}

    async def before_route(self, route: str) -> None:
        """Applied to every request before its handler runs."""
        delay = self.slow.get(route, 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        if route in self.hang:
            await asyncio.Event().wait()


def add_route_fault_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The faults group with the flags every engine takes (`route_faults` reads them); returns the group
    for the engine's own."""
    group = parser.add_argument_group("faults (also settable at runtime: POST /_emulator/faults)")
    group.add_argument("--fault-slow", action="append", default=[], metavar="ROUTE=SECONDS")
    group.add_argument("--fault-hang", action="append", default=[], metavar="ROUTE")
    return group


def route_faults(args: argparse.Namespace) -> dict[str, Any]:
    """`Faults`' `slow` and `hang` from the flags of `add_route_fault_flags`."""
    return {"slow": parse_route_seconds(args.fault_slow), "hang": set(args.fault_hang)}


def parse_renames(items: list[str]) -> dict[str, str]:
    """`a=b` (repeatable flag) -> {"a": "b"}: the tensor named a is stored in the parameter of b."""
    out: dict[str, str] = {}
    for item in items:
        src, _, dst = item.partition("=")
        if not src or not dst:
            raise ValueError(f"expected TENSOR=TENSOR, got {item!r}")
        out[src] = dst
    return out


def parse_route_seconds(items: list[str]) -> dict[str, float]:
    """`/flush_cache=2.5` (repeatable flag) -> {"/flush_cache": 2.5}."""
    out: dict[str, float] = {}
    for item in items:
        route, _, seconds = item.partition("=")
        if not route.startswith("/") or not seconds:
            raise ValueError(f"expected ROUTE=SECONDS, got {item!r}")
        out[route] = float(seconds)
    return out
