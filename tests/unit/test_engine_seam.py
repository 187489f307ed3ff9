"""The engine seam holds: an engine's route strings, its conformance row IDs, its quirks and its name stay in
its own folders (agent/engines/<name>/, trainer/engines/<name>/). Everything else in the product speaks of
"the engine" and calls the verbs of agent/engines/base.py; only the registries name the engines: the
agent's (agent/engines/__init__.py) and the trainer SDK's (trainer/engines/__init__.py), which never
imports the agent. The test world (rljob.emulator, rljob.testing) is outside the check: it plays the
engines.

Run as a script to print the files that still mention an engine outside its folders:
    python tests/unit/test_engine_seam.py
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "rljob"
# The product: every package that ships in the operator, the agent or the trainer SDK.
PRODUCT = (
    "api",
    "lifecycle",
    "controller",
    "agent",
    "trainer",
    "cli",
    "kubeclient",
    "event_loop.py",
    "__init__.py",
)
ROUTE = re.compile(r"^/[a-z][a-z0-9_]*(/[a-z0-9_]+)*$")
REGISTRIES = ("agent/engines/__init__.py", "trainer/engines/__init__.py")
# Paths another server of the product's world serves too: a string naming one is not an engine's.
OTHER_SERVERS = {"/version": "the Kubernetes API server's version (controller/main.py)"}


@dataclass(frozen=True)
class EngineSeam:
    """What belongs to one engine: its name, where its code lives, and the conformance document whose row
    IDs cite its behaviour."""

    name: str
    folders: tuple[str, ...]  # relative to operator/rljob, ending in "/"
    conformance: str  # relative to the repository root

    def owns(self, rel: str) -> bool:
        return any(rel.startswith(f) for f in self.folders)

    def sources(self) -> list[Path]:
        out: list[Path] = []
        for f in self.folders:
            p = PACKAGE / f
            out += sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.is_file() else []
        return out

    def routes(self) -> frozenset[str]:
        """Every route-shaped string literal in the engine's folders: the paths its client calls and its
        framework endpoint answers."""
        return frozenset(s for p in self.sources() for s in string_literals(p.read_text()) if ROUTE.match(s))

    def quirks(self) -> frozenset[str]:
        """The properties of the engine's quirks classes (a class named `...Quirks` in its folders)."""
        names: set[str] = set()
        for p in self.sources():
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Quirks"):
                    names |= {
                        f.name
                        for f in node.body
                        if isinstance(f, ast.FunctionDef)
                        and any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
                    }
        return frozenset(names)

    def rows(self) -> frozenset[str]:
        text = (ROOT / self.conformance).read_text() if (ROOT / self.conformance).exists() else ""
        return frozenset(re.findall(r"^\| ([A-Z]-[A-Z0-9]+(?:-[A-Z0-9]+)*) \|", text, re.M))


ENGINES = (
    EngineSeam(
        "sglang",
        (
            "agent/engines/sglang/",
            "trainer/engines/sglang/",
        ),
        "docs/sglang-conformance.md",
    ),
    EngineSeam(
        "vllm",
        (
            "agent/engines/vllm/",
            "trainer/engines/vllm/",
        ),
        "docs/vllm-conformance.md",
    ),
)

# Mentions outside an engine's folders that the seam keeps on purpose: (file, a regex the line matches, why).
KEPT = (
    ("api/spec.py", r'^\s+SGLANG = "sglang"$', "the EngineKind value: a CRD and wire value"),
    ("api/spec.py", r'^\s+VLLM = "vllm"$', "the EngineKind value: a CRD and wire value"),
    (
        "api/spec.py",
        r'^ENGINE_LABELS = \{EngineKind\.SGLANG: "SGLang", EngineKind\.VLLM: "vLLM"\}$',
        "how messages name each engine",
    ),
    (
        "api/spec.py",
        r"^\s+EngineKind\.(SGLANG|VLLM): EngineTraits\($",
        "what a job may ask of each engine: its defaults and admission rules (the CRD's)",
    ),
    ("api/spec.py", r"^DEFAULT_ENGINE = EngineKind\.SGLANG$", "the engine a job runs unless it names one"),
    (
        "api/agent.py",
        r'AliasChoices\("engine", "sglang"\)',
        "the previous release's key, read for one release",
    ),
    ("api/agent.py", r'"sglangSeconds"\)', "the previous release's key, read for one release"),
)


def string_literals(source: str) -> list[str]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # an f-string: its literal parts are not routes
                continue
            if isinstance(value, str):
                out.append(value)
    return out


@dataclass(frozen=True)
class Mention:
    rel: str
    line: int
    engine: str
    what: str  # route | row | quirk | name
    text: str

    def __str__(self) -> str:
        return f"{self.rel}:{self.line}: {self.engine} {self.what} {self.text!r}"


@dataclass(frozen=True)
class Known:
    """What the check looks for, per engine."""

    name: str
    routes: frozenset[str]
    rows: frozenset[str]
    quirks: frozenset[str]
    owns: tuple[str, ...]


def known() -> list[Known]:
    served = agent_routes() | OTHER_SERVERS.keys()
    return [Known(e.name, e.routes() - served, e.rows(), e.quirks(), e.folders) for e in ENGINES]


def agent_routes() -> frozenset[str]:
    """The agent's own routes (its OpenAPI document): a string naming one is the agent's, not an engine's."""
    sys.path.insert(0, str(ROOT / "operator"))
    from rljob.agent.openapi import ROUTES

    return frozenset(r.path for r in ROUTES)


def scan(rel: str, source: str, engines: Iterable[Known]) -> list[Mention]:
    """Each mention of an engine in `source` (the file `rel`, relative to operator/rljob) outside that
    engine's folders: a string equal to one of its routes (or the route with a query or a sub-path), one of
    its conformance row IDs anywhere, an identifier naming one of its quirks, its name in any identifier,
    string, docstring or comment. In another engine's folder a route or a quirk that engine has too is its
    own (two engines may both serve `/server_info`)."""
    found: list[Mention] = []
    lines = source.splitlines()
    engines = list(engines)
    home = next((o for o in engines if any(rel.startswith(f) for f in o.owns)), None)
    for e in engines:
        if rel in REGISTRIES or any(rel.startswith(f) for f in e.owns):
            continue
        routes = e.routes - home.routes if home is not None else e.routes
        quirks = e.quirks - home.quirks if home is not None else e.quirks
        word = re.compile(re.escape(e.name), re.I)
        row_ids = (
            re.compile(r"\b(" + "|".join(map(re.escape, sorted(e.rows, reverse=True))) + r")\b")
            if e.rows
            else None
        )
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            n, text = tok.start[0], tok.string
            if n > len(lines) or any(rel == f and re.search(pat, lines[n - 1]) for f, pat, _ in KEPT):
                continue
            if tok.type == tokenize.STRING:
                try:
                    value = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    value = None
                if isinstance(value, str) and _is_route(value, routes):
                    found.append(Mention(rel, n, e.name, "route", value))
            if tok.type == tokenize.NAME and text in quirks:
                found.append(Mention(rel, n, e.name, "quirk", text))
            if tok.type in (tokenize.STRING, tokenize.COMMENT, tokenize.NAME) or tok.type == getattr(
                tokenize, "FSTRING_MIDDLE", -1
            ):
                if row_ids is not None:
                    found += [Mention(rel, n, e.name, "row", m.group(1)) for m in row_ids.finditer(text)]
                if word.search(text):
                    found.append(Mention(rel, n, e.name, "name", text[:60]))
    return found


def _is_route(value: str, routes: frozenset[str]) -> bool:
    return value in routes or any(
        value.startswith(r) and value[len(r)] in "?/" for r in routes if len(value) > len(r)
    )


def product_files() -> list[Path]:
    out: list[Path] = []
    for part in PRODUCT:
        p = PACKAGE / part
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def mentions() -> list[Mention]:
    engines = known()
    return [
        m for p in product_files() for m in scan(p.relative_to(PACKAGE).as_posix(), p.read_text(), engines)
    ]


def by_file(found: Iterable[Mention]) -> dict[str, int]:
    lines: dict[str, set[int]] = {}
    for m in found:
        lines.setdefault(m.rel, set()).add(m.line)
    return {rel: len(n) for rel, n in sorted(lines.items())}


def report(found: list[Mention]) -> str:
    counts = by_file(found)
    rows = [f"  {rel}: {n} line(s)" for rel, n in counts.items()]
    return "files that mention an engine outside its folders (the registries aside):\n" + (
        "\n".join(rows) if rows else "  none"
    )


# --- the check ------------------------------------------------------------------------------------------


def test_no_engine_leaks_outside_its_folders() -> None:
    found = mentions()
    print(report(found))
    assert not found, "an engine's routes, rows, quirks or name outside its folders:\n" + "\n".join(
        map(str, found)
    )


EXPECTED = {  # a few of each engine's routes, rows and quirks the check must find
    "sglang": (
        {"/flush_cache", "/release_memory_occupation", "/update_weights_from_disk"},
        {"C-MEM-DOUBLE-RELEASE", "C-DEATH-HARD", "C-ROUTE-FLUSH"},
        {"flush_takes_timeout", "subprocess_watchdog"},
    ),
    "vllm": (
        {"/sleep", "/wake_up", "/reset_prefix_cache", "/collective_rpc", "/update_weights"},
        {"V-MEM-WAKE-ORDER", "V-KILL-REFIT-FAILED", "V-ROUTE-FLUSH"},
        {"carries_weight_version", "packed_in_init_info"},
    ),
}


def test_the_check_knows_each_engine() -> None:
    """The check reads the engine's routes, rows and quirks from its folders and its conformance document:
    an empty set would make it pass vacuously."""
    assert {e.name for e in known()} == set(EXPECTED)
    for e in known():
        routes, rows, quirks = EXPECTED[e.name]
        assert routes <= e.routes, e.name
        assert "/metrics" not in e.routes  # the agent's own route too: not counted as the engine's
        assert rows <= e.rows, e.name
        assert quirks <= e.quirks, e.name


# --- the check can fail -----------------------------------------------------------------------------------

LEAKY = """
async def drain(client):
    await client.call("/flush_cache?timeout=1")  # C-MEM-DOUBLE-RELEASE
    return client.quirks.flush_takes_timeout
"""


def test_a_route_a_row_and_a_quirk_outside_the_folder_are_found() -> None:
    found = scan("agent/operations.py", LEAKY, known())
    assert sorted((m.what, m.text) for m in found) == [
        ("quirk", "flush_takes_timeout"),
        ("route", "/flush_cache?timeout=1"),
        ("row", "C-MEM-DOUBLE-RELEASE"),
    ]


def test_the_name_is_found_in_code_strings_and_comments() -> None:
    source = 'from x import SGLangClient\nmessage = "SGLang died"\nport = 1  # sglang\n'
    assert [(m.line, m.what) for m in scan("lifecycle/machine.py", source, known())] == [
        (1, "name"),
        (2, "name"),
        (3, "name"),
    ]


def test_the_same_text_inside_the_engine_folder_is_its_own() -> None:
    for rel in ("agent/engines/sglang/engine.py", "trainer/engines/sglang/packing.py", *REGISTRIES):
        assert scan(rel, LEAKY + "# SGLang\n", known()) == [], rel


def test_one_engine_in_the_others_folder_is_found() -> None:
    """vLLM's folder may serve a route SGLang serves too (both have `/server_info`), but SGLang's own
    route, row or name there is a leak, and so is vLLM's in SGLang's folder."""
    assert sorted((m.what, m.text) for m in scan("agent/engines/vllm/engine.py", LEAKY, known())) == [
        ("quirk", "flush_takes_timeout"),
        ("route", "/flush_cache?timeout=1"),
        ("row", "C-MEM-DOUBLE-RELEASE"),
    ]
    shared = 'x = "/server_info"\n'
    assert scan("agent/engines/vllm/client.py", shared, known()) == []
    vllm_in_sglang = 'await c.call("/wake_up")  # V-MEM-WAKE-ORDER, vLLM\n'
    found = scan("agent/engines/sglang/engine.py", vllm_in_sglang, known())
    assert {(m.engine, m.what) for m in found} == {("vllm", "route"), ("vllm", "row"), ("vllm", "name")}


if __name__ == "__main__":
    print(report(mentions()))
