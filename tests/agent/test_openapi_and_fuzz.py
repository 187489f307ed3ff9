"""The committed OpenAPI document matches the models and routes; fuzzing both agent listeners from it
finds no 5xx and no crash, and never kills SGLang."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import schemathesis
from agent_procs import Agent, Emulator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from rljob.agent.openapi import ROUTES, build_document
from rljob.emulator.probe import PROBE as EMULATOR_PROBE

DOC = Path(__file__).resolve().parents[2] / "docs" / "agent-openapi.json"


def test_committed_document_has_no_drift() -> None:
    committed = json.loads(DOC.read_text())
    assert committed == build_document(), (
        "docs/agent-openapi.json is stale: run `python -m rljob.agent.openapi > docs/agent-openapi.json`"
    )


def test_document_covers_every_route(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    from rljob.agent.app import Agent as AgentApp
    from rljob.agent.config import parse_config
    from rljob.agent.operator_api import build_operator_app
    from rljob.agent.trainer_api import build_trainer_app

    served = build_document()
    served_live = start_agent(start_emulator("0.5.23")).get("/openapi.json", token=None).body
    assert served_live == served
    documented = {(r.method.upper(), r.path) for r in ROUTES}
    token = tmp_path / "token"
    token.write_text("t")
    app = AgentApp(parse_config(["--token-file", str(token), "--gpu-probe", EMULATOR_PROBE]))
    routes: set[tuple[str, str]] = set()
    for web_app in (
        build_operator_app(app.store, app.desk, app.metrics, "t"),
        build_trainer_app(app.store, app.lease, app.windows, app.metrics),
    ):
        for r in web_app.router.routes():
            if r.method != "HEAD":
                routes.add((r.method, r.resource.canonical))  # type: ignore[union-attr]
    assert routes == documented


def _strategy(doc: dict[str, Any], tag: str) -> st.SearchStrategy[Any]:
    paths = {p: ops for p, ops in doc["paths"].items() if tag in next(iter(ops.values()))["tags"]}
    schema = schemathesis.openapi.from_dict({**doc, "paths": paths})
    strategies = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(op.as_strategy(generation_mode=mode))
    return st.one_of(strategies)


def test_fuzz_both_listeners(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    doc = build_document()
    seen: dict[int, int] = {}
    auth = {"Authorization": f"Bearer {agent.token}"}

    def call(case: Any, base_url: str, headers: dict[str, str]) -> None:
        if case.query and "wait" in case.query:
            case.query["wait"] = 0.1  # long-polls would only slow the fuzzer down
        resp = case.call(base_url=base_url, headers=headers, timeout=20)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500 or resp.status_code in (502, 504), (
            f"{case.method} {case.path} {case.query} {case.body!r} -> {resp.status_code} {resp.text[:300]}"
        )
        if 400 <= resp.status_code < 500 and resp.status_code not in (404, 405):
            body = resp.json()
            assert set(body) == {"error", "reason", "permanent"}, body

    fuzz = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))

    @fuzz
    @given(case=_strategy(doc, "operator"))
    def operator_side(case: Any) -> None:
        call(case, agent.url, auth)

    @fuzz
    @given(case=_strategy(doc, "trainer"))
    def trainer_side(case: Any) -> None:
        call(case, agent.trainer_url, {})

    operator_side()
    trainer_side()
    assert agent.alive() and agent.get("/healthz", token=None).body["ok"] is True
    assert emu.alive()
    print("fuzz status codes:", dict(sorted(seen.items())))
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen
