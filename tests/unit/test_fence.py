"""The fence between the product and its test world (like kopf and kopf.testing). The product is every module
under operator/rljob outside `rljob.testing` and `rljob.emulator` (rljob/__init__.py and event_loop.py
included). No product module imports the test world in any form (absolute or relative import statements,
`from rljob import testing`, importlib / __import__ strings), none names the emulator, and importing every
product module in a fresh interpreter loads no test-world module. The layers between product packages are
declared in .importlinter (`make lint`); import-linter reads import statements only, this file the rest."""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOT = ROOT / "operator"
PRODUCT = ("api", "lifecycle", "kubeclient", "controller", "agent", "trainer", "cli")
TEST_WORLD = ("rljob.testing", "rljob.emulator")
NAMES_THE_TEST_WORLD = re.compile(r"\brljob\.(testing|emulator)\b")
DYNAMIC = "<dynamic import>"
# Where the product imports a module named at run time: (file, enclosing function). The agent's
# `--gpu-probe package.module:factory` is the one plugin seam (the tests pass the emulator's probe there).
DYNAMIC_IMPORT_SEAMS = {("operator/rljob/agent/gpu_probe.py", "make_probe")}


def in_test_world(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in TEST_WORLD)


def module_of(path: Path, source_root: Path) -> tuple[str, bool]:
    """The dotted module name of a source file, and whether it is a package's __init__."""
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def product_files(source_root: Path = SOURCE_ROOT) -> list[Path]:
    return sorted(
        p
        for p in (source_root / "rljob").rglob("*.py")
        if "__pycache__" not in p.parts and not in_test_world(module_of(p, source_root)[0])
    )


def resolve_relative(path: Path, source_root: Path, level: int, target: str | None) -> str:
    """`from <level dots><target> import ...` in `path`, as an absolute module name (importlib's rule)."""
    module, is_package = module_of(path, source_root)
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(package):
        raise ValueError(f"{path}: relative import beyond the top-level package")
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, target] if target else base)


@dataclass(frozen=True)
class Reference:
    """A module a source file imports or names: where, what, and the function it sits in."""

    line: int
    module: str
    function: str


class References(ast.NodeVisitor):
    def __init__(self, path: Path, source_root: Path) -> None:
        self.path, self.source_root = path, source_root
        self.found: list[Reference] = []
        self.functions: list[str] = []

    def add(self, node: ast.AST, module: str) -> None:
        self.found.append(Reference(getattr(node, "lineno", 0), module, ".".join(self.functions)))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            base = resolve_relative(self.path, self.source_root, node.level, node.module)
        self.add(node, base)
        for alias in node.names:  # `from rljob import testing` imports the submodule rljob.testing
            if alias.name != "*":
                self.add(node, f"{base}.{alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args:
            target = node.args[0]
            package = node.args[1] if len(node.args) > 1 and name == "import_module" else None
            package = next((k.value for k in node.keywords if k.arg == "package"), package)
            if not (isinstance(target, ast.Constant) and isinstance(target.value, str)):
                self.add(node, DYNAMIC)
            elif target.value.startswith("."):
                if isinstance(package, ast.Constant) and isinstance(package.value, str):
                    level = len(target.value) - len(target.value.lstrip("."))
                    self.add(node, f"{package.value}.{target.value[level:]}" if level == 1 else DYNAMIC)
                else:
                    self.add(node, DYNAMIC)
            else:
                self.add(node, target.value)
                # __import__("rljob", fromlist=["testing"]) imports the submodule rljob.testing
                fromlist = node.args[3] if len(node.args) > 3 and name == "__import__" else None
                fromlist = next((k.value for k in node.keywords if k.arg == "fromlist"), fromlist)
                if isinstance(fromlist, ast.List | ast.Tuple):
                    for item in fromlist.elts:
                        named = item.value if isinstance(item, ast.Constant) else None
                        self.add(node, f"{target.value}.{named}" if isinstance(named, str) else DYNAMIC)
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring or bare string: it runs nothing
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        # find_spec, runpy, exec, `python -m rljob.emulator`: a string naming the test world is a crossing.
        if isinstance(node.value, str):
            for match in NAMES_THE_TEST_WORLD.finditer(node.value):
                self.add(node, match.group(0))


def references(path: Path, source_root: Path = SOURCE_ROOT) -> list[Reference]:
    visitor = References(path, source_root)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found


def crossings(files: list[Path], source_root: Path = SOURCE_ROOT) -> list[str]:
    """Every reference to the test world, and every import of a module named at run time outside the seams."""
    found = []
    for path in files:
        rel = path.relative_to(source_root.parent).as_posix()
        for ref in references(path, source_root):
            dynamic_outside_seams = ref.module == DYNAMIC and (rel, ref.function) not in DYNAMIC_IMPORT_SEAMS
            if in_test_world(ref.module) or dynamic_outside_seams:
                found.append(f"{rel}:{ref.line}: {ref.module}")
    return found


def test_the_product_is_every_module_outside_the_test_world() -> None:
    modules = {module_of(p, SOURCE_ROOT)[0] for p in product_files()}
    assert {"rljob", "rljob.event_loop"} <= modules
    assert {f"rljob.{pkg}" for pkg in PRODUCT} <= modules
    assert not [m for m in modules if in_test_world(m)]
    packages = {p.name for p in (SOURCE_ROOT / "rljob").iterdir() if (p / "__init__.py").exists()}
    assert packages == {*PRODUCT, "testing", "emulator"}, "a new package: product or test world?"


def test_product_never_imports_the_test_world() -> None:
    assert crossings(product_files()) == []


def test_import_linter_forbids_the_test_world_to_every_product_package() -> None:
    """.importlinter's forbidden contract names every top-level product package and module (from the tree,
    so a new one cannot be left out), and its layers are checked exhaustively."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    contract = config["importlinter:contract:test-world"]
    top_level = {
        module_of(p, SOURCE_ROOT)[0]
        for p in [*(SOURCE_ROOT / "rljob").glob("*.py"), *(SOURCE_ROOT / "rljob").glob("*/__init__.py")]
    }
    product = {m for m in top_level if not in_test_world(m)} - {"rljob"}  # rljob/__init__.py: checked above
    assert set(contract["source_modules"].split()) == product
    assert set(contract["forbidden_modules"].split()) == set(TEST_WORLD)
    assert config["importlinter:contract:layers"]["exhaustive"] == "True"


def test_dynamic_imports_stay_at_the_declared_seams() -> None:
    """Each seam still exists (the list cannot go stale) and imports a module named at run time there."""
    seen = {
        (p.relative_to(ROOT).as_posix(), ref.function)
        for p in product_files()
        for ref in references(p)
        if ref.module == DYNAMIC
    }
    assert seen == DYNAMIC_IMPORT_SEAMS


OFFENDING_SOURCES = {
    "import": ("rljob/agent/x.py", "import rljob.testing.kubelet\n"),
    "import-as": ("rljob/agent/x.py", "import rljob.emulator as sim\n"),
    "from-module": ("rljob/agent/x.py", "from rljob.testing.kubelet import Kubelet\n"),
    "from-rljob-import-testing": ("rljob/agent/x.py", "from rljob import testing\n"),
    "from-rljob-import-list": ("rljob/cli/x.py", "from rljob import api, emulator as sim\n"),
    "relative-parent": ("rljob/agent/x.py", "from .. import testing\n"),
    "relative-module": ("rljob/controller/x.py", "from ..emulator.server import main\n"),
    "relative-in-package-init": ("rljob/__init__.py", "from . import emulator\n"),
    "relative-in-event-loop": ("rljob/event_loop.py", "from .testing import cluster\n"),
    "lazy-in-function": ("rljob/trainer/x.py", "def f():\n    from rljob.testing import demo\n"),
    "importlib": ("rljob/agent/x.py", "import importlib\nimportlib.import_module('rljob.testing.pods')\n"),
    "importlib-relative": (
        "rljob/agent/x.py",
        "from importlib import import_module\nimport_module('.emulator', package='rljob')\n",
    ),
    "importlib-computed": ("rljob/agent/x.py", "import importlib\nimportlib.import_module('rljob.' + 'x')\n"),
    "dunder-import": ("rljob/lifecycle/x.py", "__import__('rljob.emulator.server')\n"),
    "dunder-import-fromlist": ("rljob/lifecycle/x.py", "__import__('rljob', fromlist=['testing'])\n"),
    "find-spec": ("rljob/cli/x.py", "import importlib.util\nimportlib.util.find_spec('rljob.testing')\n"),
    "python-m": (
        "rljob/controller/x.py",
        "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'rljob.emulator'])\n",
    ),
}


@pytest.mark.parametrize("case", sorted(OFFENDING_SOURCES))
def test_the_fence_catches_each_import_form(case: str, tmp_path: Path) -> None:
    relative, source = OFFENDING_SOURCES[case]
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert path in product_files(tmp_path)
    assert len(crossings([path], tmp_path)) >= 1, source


def test_the_fence_passes_product_only_imports(tmp_path: Path) -> None:
    """The same forms, naming product modules: no crossing (the check is not just "any import")."""
    path = tmp_path / "rljob" / "agent" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text(
        '"""Not rljob.testing: a docstring runs nothing."""\n'
        "import rljob.api\nfrom rljob import lifecycle\nfrom .. import trainer\nfrom .state import S\n"
        "import importlib\nimportlib.import_module('rljob.cli')\nimportlib.import_module('.api', 'rljob')\n"
    )
    assert crossings([path], tmp_path) == []
    resolved = {r.module for r in references(path, tmp_path)}
    assert resolved >= {"rljob.trainer", "rljob.agent.state", "rljob.api"}


# --- at run time: a fresh interpreter imports every product module ----------------------------------------

PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
test_world = (["rljob", "testing"], ["rljob", "emulator"])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[:2] in test_world)))
"""


def loaded_test_world(modules: list[str], *path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (*path, SOURCE_ROOT))}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(modules)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


def importable_product_modules() -> list[str]:
    """Every product module; a `__main__` runs its program when imported: the static checks cover those."""
    modules = [module_of(p, SOURCE_ROOT)[0] for p in product_files()]
    return [m for m in modules if m.split(".")[-1] != "__main__"]


def test_importing_every_product_module_loads_no_test_world() -> None:
    modules = importable_product_modules()
    assert len(modules) > 50 and "rljob.controller.handlers" in modules and "rljob.event_loop" in modules
    assert loaded_test_world(modules) == []


def test_the_run_time_check_sees_a_crossing(tmp_path: Path) -> None:
    """An import of the test world that no static check resolves (a computed name) is caught at run time."""
    offender = "import importlib\nimportlib.import_module('rljob.' + 'emulator.bodies')\n"
    (tmp_path / "offender.py").write_text(offender)
    loaded = loaded_test_world(["rljob.api", "offender"], tmp_path)
    assert "rljob.emulator.bodies" in loaded


# --- names and libraries ----------------------------------------------------------------------------------


def test_product_never_names_the_emulator() -> None:
    named = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in product_files()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "emulator" in line.lower()
    ]
    assert named == []


TEST_WORLD_LIBRARIES = ("requests",)  # the testing extra's (pyproject.toml)
CREDENTIALS_MODULE = "operator/rljob/kubeclient/credentials.py"  # the one reader of `kubernetes`


def imported_top_levels(path: Path) -> Iterator[str]:
    for ref in references(path):
        yield ref.module.split(".")[0]


def test_only_the_credentials_module_imports_the_kubernetes_library() -> None:
    """The operator's credentials come from `kubernetes.config` (kubeclient/credentials.py); every call goes
    over the shared client's own transport (kubeclient/apiserver.py), so no other product module imports the
    library (the agent, which has no credentials at all, least of all), and requests is the test world's."""
    uses = {
        str(p.relative_to(ROOT)): sorted(
            {m for m in imported_top_levels(p) if m in ("kubernetes", *TEST_WORLD_LIBRARIES)}
        )
        for p in product_files()
    }
    assert {k: v for k, v in uses.items() if v} == {CREDENTIALS_MODULE: ["kubernetes"]}
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in core if d.split(">")[0].split("<")[0].strip() in TEST_WORLD_LIBRARIES] == []


def console_scripts() -> dict[str, str]:
    scripts: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_console_script_imports_and_prints_help(script: str) -> None:
    module, _, func = console_scripts()[script].partition(":")
    code = f"import sys; sys.argv = [{script!r}, '--help']; from {module} import {func}; sys.exit({func}())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage" in done.stdout.lower(), done.stdout
