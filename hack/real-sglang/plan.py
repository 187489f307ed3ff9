"""pack.sh's bookkeeping: which resolved packages go into the pack, which wheels are missing, whether each
wheel installs on the GPU machine's Python, and what the pack asks of the image's own packages.

    plan.py select CLOSURE IMAGE_PACKAGES REQUIREMENTS_IN   -> name==version to carry, one a line
    plan.py missing PACK_LIST WHEEL_DIR                     -> name==version with no wheel in WHEEL_DIR
    plan.py wheels PACK_LIST WHEEL_DIR                      -> the wheel file for each, in PACK_LIST's order
    plan.py check-tags WHEEL...                             -> exit 1 unless each is cp312/abi3/py3, x86_64
    plan.py image-requirements PACK_LIST WHEEL_DIR IMAGE_PACKAGES
                                       -> name, specifier, required-by for each image package the pack needs
Runs with the tools venv (packaging).
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

# The GPU machine: CPython 3.12.3 on x86_64 Linux with glibc >= 2.34 (uv's x86_64-manylinux_2_34).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(34, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
TARGET_TAGS: set[Tag] = set(cpython_tags((3, 12), ["cp312", "abi3", "none"], PLATFORMS)) | set(
    compatible_tags((3, 12), "cp312", PLATFORMS)
)
TARGET_ENV = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


def names_in(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]))
    return names


def pinned(path: Path) -> list[tuple[str, str]]:
    """name, version of each `name==version` line (uv's output, the pack list)."""
    found = []
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        if match:
            found.append((canonicalize_name(match.group(1)), match.group(2)))
    return found


def select(closure: Path, image_packages: Path, requirements_in: Path) -> None:
    image = names_in(image_packages)
    asked = names_in(requirements_in)
    for name, version in pinned(closure):
        if name not in image or name in asked:
            print(f"{name}=={version}")


def wheel_for(name: str, version: str, wheel_dir: Path) -> Path | None:
    for wheel in wheel_dir.glob("*.whl"):
        wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
        if wheel_name == name and str(wheel_version) == str(type(wheel_version)(version)):
            return wheel
    return None


def missing(pack_list: Path, wheel_dir: Path) -> None:
    for name, version in pinned(pack_list):
        if wheel_for(name, version, wheel_dir) is None:
            print(f"{name}=={version}")


def wheels(pack_list: Path, wheel_dir: Path) -> None:
    for name, version in pinned(pack_list):
        wheel = wheel_for(name, version, wheel_dir)
        if wheel is None:
            sys.exit(f"no wheel for {name}=={version} in {wheel_dir}")
        print(wheel)


def check_tags(paths: list[str]) -> None:
    bad = [p for p in paths if not (parse_wheel_filename(Path(p).name)[3] & TARGET_TAGS)]
    for path in bad:
        print(f"not installable on CPython 3.12 x86_64 manylinux_2_34: {Path(path).name}", file=sys.stderr)
    if bad:
        sys.exit(1)
    print(f"{len(paths)} wheels, each cp312, abi3 or py3 for x86_64 manylinux (<= 2.34) or any")


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(archive.read(metadata).decode())
    out = []
    for line in headers.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(TARGET_ENV | {"extra": ""}):
            out.append(requirement)
    return out


def image_requirements(pack_list: Path, wheel_dir: Path, image_packages: Path) -> None:
    image = names_in(image_packages)
    packed = {name for name, _ in pinned(pack_list)}
    asked: dict[str, tuple[SpecifierSet, list[str]]] = {}
    for name, version in pinned(pack_list):
        wheel = wheel_for(name, version, wheel_dir)
        assert wheel is not None, name
        for requirement in requires(wheel):
            dep = canonicalize_name(requirement.name)
            if dep in image and dep not in packed:
                specifier, by = asked.setdefault(dep, (SpecifierSet(), []))
                asked[dep] = (specifier & requirement.specifier, [*by, name])
    for dep in sorted(asked):
        specifier, by = asked[dep]
        print(f"{dep}\t{specifier or '*'}\t{','.join(sorted(set(by)))}")


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "select":
        select(Path(args[0]), Path(args[1]), Path(args[2]))
    elif command == "missing":
        missing(Path(args[0]), Path(args[1]))
    elif command == "wheels":
        wheels(Path(args[0]), Path(args[1]))
    elif command == "check-tags":
        check_tags(args)
    elif command == "image-requirements":
        image_requirements(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
