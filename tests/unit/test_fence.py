"""The fence between the product and its test world (like kopf and kopf.testing): product packages never
import `rljob.testing` or `rljob.emulator` and never name the emulator; every console script runs."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("api", "lifecycle", "controller", "agent", "trainer", "cli")
TEST_WORLD = ("rljob.testing", "rljob.emulator")


def product_files() -> list[Path]:
    return sorted(p for pkg in PRODUCT for p in (ROOT / "operator" / "rljob" / pkg).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_product_never_imports_the_test_world() -> None:
    assert product_files(), "no product sources found"
    crossing = {
        str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.startswith(TEST_WORLD))
        for p in product_files()
    }
    assert {k: v for k, v in crossing.items() if v} == {}


def test_product_never_names_the_emulator() -> None:
    named = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in product_files()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "emulator" in line.lower()
    ]
    assert named == []


TEST_WORLD_LIBRARIES = ("kubernetes", "requests")  # the testing extra's (pyproject.toml)


def test_product_needs_no_client_library() -> None:
    """The product speaks to the API server itself (controller/apiserver.py); the generated client and
    requests are the test world's dependencies only, and the images install neither."""
    crossing = {
        str(p.relative_to(ROOT)): sorted(
            m for m in imported_modules(p) if m.split(".")[0] in TEST_WORLD_LIBRARIES
        )
        for p in product_files()
    }
    assert {k: v for k, v in crossing.items() if v} == {}
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in core if d.split(">")[0].split("<")[0].strip() in TEST_WORLD_LIBRARIES] == []


def test_the_operator_process_never_loads_the_kubernetes_client() -> None:
    """kopf imports it whenever it is installed (kopf/_cogs/helpers/thirdparty.py:35@1.45.2), as it is in
    the test world's environment: the operator's entry point keeps it out (controller/main.py)."""
    probe = (
        "import sys; from rljob.controller import main; main.without_the_kubernetes_client(); "
        "import kopf, rljob.controller.handlers; "
        "loaded = sorted(m for m, v in sys.modules.items() if m.split('.')[0] == 'kubernetes' and v); "
        "print(loaded)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    # Without the guard kopf does load it here (the testing extra installs it): the probe can fail.
    unguarded = probe.replace("main.without_the_kubernetes_client(); ", "")
    out = subprocess.run([sys.executable, "-c", unguarded], capture_output=True, text=True, check=True)
    assert "kubernetes.client" in out.stdout


def test_the_fence_check_sees_a_crossing(tmp_path: Path) -> None:
    """The two checks above can fail: a file that imports the test world is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from rljob.testing.kubelet import Kubelet\nimport rljob.emulator.server\n")
    assert imported_modules(bad) >= {"rljob.testing.kubelet", "rljob.emulator.server"}


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
