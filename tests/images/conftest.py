"""Fixtures for the images tier: the images of images/*/Dockerfile built with buildah (hack/build-images.sh,
daemonless, from a base made locally from Debian packages) and run from their own root filesystem.

A container runs with runc (an OCI runtime) from the image's mounted root filesystem: read-only, as the
image's user, no capabilities, own pid/ipc/uts/mount namespaces, the host's network (so a test reaches
the agent on 127.0.0.1). Without runc, `unshare` + `chroot --userspec` stand in (same user and read-only
root, fewer namespaces). The tier is skipped, with the reason, when buildah is missing or cannot build
here, unless RLJOB_REQUIRE_IMAGES=1 (CI sets it): then that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from image_runtime import Image, Runtime

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "hack" / "build-images.sh"
REQUIRED = os.environ.get("RLJOB_REQUIRE_IMAGES") == "1"
SIZES: dict[str, str] = {}  # image -> size, printed at the end of the run


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "images: builds the container images with buildah and runs them")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SIZES:
        terminalreporter.section("image sizes (buildah, local Debian base)")
        for ref, size in SIZES.items():
            terminalreporter.write_line(f"{ref}  {size}")


def unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"RLJOB_REQUIRE_IMAGES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def buildah_flags() -> list[str]:
    """The storage flags hack/build-images.sh uses (`--print`), so both see the same images."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("buildah_flags "))
    return line.split()[1:]


def image_refs() -> dict[str, str]:
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True, check=True)
    return {ln.split()[1]: ln.split()[2] for ln in out.stdout.splitlines() if ln.startswith("image ")}


@pytest.fixture(scope="session")
def buildah() -> list[str]:
    """`buildah` with the build script's storage flags, once buildah answers here."""
    if shutil.which("buildah") is None or shutil.which("debootstrap") is None:
        unavailable("buildah/debootstrap not installed (Debian: apt-get install buildah debootstrap runc; "
                    ".ci/run installs them)")  # fmt: skip
    command = ["buildah", *buildah_flags()]
    probe = subprocess.run([*command, "images", "-q"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        unavailable(f"buildah cannot use its storage here: {probe.stderr.strip()[-500:]}")
    return command


@pytest.fixture(scope="session")
def built_images(buildah: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Image]]:
    """hack/build-images.sh --builder buildah (a cold run debootstraps the base: minutes), then every
    image mounted from a working container (removed afterwards)."""
    log = tmp_path_factory.mktemp("images") / "build.log"
    with open(log, "wb") as out:
        done = subprocess.run(["bash", str(BUILD_SCRIPT), "--builder", "buildah"], stdout=out,
                              stderr=subprocess.STDOUT, timeout=1700, check=False)  # fmt: skip
    text = log.read_text(errors="replace")
    if done.returncode != 0:
        pytest.fail(f"hack/build-images.sh failed ({done.returncode}):\n{text[-4000:]}", pytrace=False)
    print(text)
    images: dict[str, Image] = {}
    containers: list[str] = []
    try:
        for name, ref in image_refs().items():
            ctr = subprocess.run(
                [*buildah, "from", "--pull=never", ref], capture_output=True, text=True, check=True
            ).stdout.strip()
            containers.append(ctr)
            rootfs = Path(
                subprocess.run(
                    [*buildah, "mount", ctr], capture_output=True, text=True, check=True
                ).stdout.strip()
            )
            inspected = json.loads(
                subprocess.run(
                    [*buildah, "inspect", "--type", "image", ref], capture_output=True, text=True, check=True
                ).stdout
            )
            listed = json.loads(
                subprocess.run(
                    [*buildah, "images", "--json", ref], capture_output=True, text=True, check=True
                ).stdout
            )
            images[name] = Image(name, ref, rootfs, inspected["OCIv1"]["config"], listed[0]["size"])
            SIZES[ref] = listed[0]["size"]
        yield images
    finally:
        for ctr in containers:
            subprocess.run([*buildah, "umount", ctr], capture_output=True, check=False)
            subprocess.run([*buildah, "rm", ctr], capture_output=True, check=False)


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    return Runtime(tmp_path_factory.mktemp("runtime"))
