"""The two distributions, built here and their files listed: rljob-operator (pyproject.toml) holds the
product only; rljob-testing (packaging/rljob-testing/pyproject.toml) holds the test world, rljob.testing and
rljob.emulator, and requires rljob-operator[testing]. In the repository the editable install (`make
install`) imports the test world from operator/ itself."""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_images import (
    ROOT,
    TESTING_PROJECT,
    build_wheel,
    console_scripts,
    module_in_wheel,
    project_version,
    wheel_names,
)

TEST_WORLD = ("rljob/testing/", "rljob/emulator/")


def sources(test_world: bool) -> set[str]:
    """The source files under operator/rljob, as wheel paths: the test world's, or the product's."""
    found = {
        p.relative_to(ROOT / "operator").as_posix()
        for p in (ROOT / "operator" / "rljob").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed")
    }
    return {n for n in found if n.startswith(TEST_WORLD) == test_world}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "product": build_wheel(tmp_path_factory),
        "testing": build_wheel(tmp_path_factory, project=TESTING_PROJECT),
    }


def package_files(whl: Path) -> set[str]:
    return {n for n in wheel_names(whl) if ".dist-info/" not in n}


def metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def test_the_product_wheel_holds_the_product_only(wheels: dict[str, Path]) -> None:
    files = package_files(wheels["product"])
    print(f"{wheels['product'].name}:", *sorted(files), sep="\n  ")
    assert sorted(n for n in files if n.startswith(TEST_WORLD)) == []
    assert files == sources(test_world=False)
    scripts = console_scripts(wheels["product"])
    assert sorted(scripts) == ["kubectl-rljob", "rljob-agent", "rljob-operator"]
    assert [s for s, target in scripts.items() if not module_in_wheel(files, target.split(":")[0])] == []


def test_the_test_world_wheel_holds_the_test_world_only(wheels: dict[str, Path]) -> None:
    files = package_files(wheels["testing"])
    print(f"{wheels['testing'].name}:", *sorted(files), sep="\n  ")
    # rljob/__init__.py is the product's: the two wheels share no file, so either uninstalls cleanly.
    assert files == sources(test_world=True)
    assert not files & package_files(wheels["product"])
    meta = metadata(wheels["testing"])
    assert (meta["Name"], meta["Version"]) == ("rljob-testing", project_version())
    assert meta.get_all("Requires-Dist") == [f"rljob-operator[testing]=={project_version()}"]


def test_both_wheels_install_into_one_tree(wheels: dict[str, Path], tmp_path: Path) -> None:
    """The testing image's install, without the dependencies: the test world lands in the product's `rljob`
    package, and a product-only install has no test world."""
    probe = """if True:
        import importlib.util, sys
        def installed(module):
            try:
                spec = importlib.util.find_spec(module)
            except ModuleNotFoundError:  # its parent package is missing
                return False
            return spec is not None and spec.origin.startswith(sys.argv[1])
        modules = ('rljob.agent.main', 'rljob.testing.demo', 'rljob.emulator.server')
        print([m for m in modules if installed(m)])
    """
    for name, installed in (("product", [wheels["product"]]), ("both", [*wheels.values()])):
        site = tmp_path / name
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site)]
        subprocess.run([*pip, *map(str, installed)], check=True, capture_output=True, timeout=120)
        env = {**os.environ, "PYTHONPATH": str(site)}  # -S: not the editable install's .pth
        done = subprocess.run(
            [sys.executable, "-S", "-c", probe, str(site)], env=env, cwd=tmp_path,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        found = done.stdout.strip()
        if name == "product":
            assert found == "['rljob.agent.main']", found
        else:
            assert found == "['rljob.agent.main', 'rljob.testing.demo', 'rljob.emulator.server']", found


def test_the_editable_install_imports_the_test_world_from_the_checkout(tmp_path: Path) -> None:
    """`make install` (pip install -e '.[testing,dev]') puts operator/ on sys.path: the demo, the fake
    kubelet's `python -m rljob.emulator` and the test tiers import the test world with no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import rljob.testing.demo, rljob.emulator.server as s; print(s.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{done.stderr[-2000:]}\n(run `make install` first)"
    assert Path(done.stdout.strip()) == ROOT / "operator" / "rljob" / "emulator" / "server.py"
