"""The images really built (buildah, hack/build-images.sh) and really run from their root filesystem, the
way the chart and the operator run them: as the image's non-root user, with a read-only root."""

from __future__ import annotations

import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from image_runtime import Bind, Image, Runtime

pytestmark = [pytest.mark.images, pytest.mark.timeout(1800)]  # a cold build debootstraps the base first

NONROOT = (65532, 65532)
PRODUCT = ("operator", "agent")
WHOAMI = "import os; print(os.getuid(), os.getgid())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("name", ["operator", "agent", "testing"])
def test_image_runs_as_its_non_root_user(name: str, built_images: dict[str, Image], runtime: Runtime) -> None:
    image = built_images[name]
    assert image.user == NONROOT, image.config.get("User")
    code, out = runtime.run(image, ["python3", "-c", WHOAMI])
    assert (code, out.split()) == (0, ["65532", "65532"]), out


@pytest.mark.parametrize("name", ["operator", "agent", "testing"])
def test_entrypoint_answers_help_on_a_read_only_root(
    name: str, built_images: dict[str, Image], runtime: Runtime
) -> None:
    image = built_images[name]
    command = image.command
    if name == "testing":  # ENTRYPOINT python3 -m, CMD rljob.testing.trainer --help
        assert command == ["python3", "-m", "rljob.testing.trainer", "--help"], command
    else:
        assert command == [f"rljob-{name}"], command
        command = [*command, "--help"]
    code, out = runtime.run(image, command)
    assert code == 0 and "usage:" in out, out
    code, out = runtime.run(image, ["python3", "-c", "open('/written-at-run-time', 'w')"])
    assert code != 0 and "Read-only file system" in out, out


@pytest.mark.parametrize("name", PRODUCT)
def test_product_images_carry_no_test_world(
    name: str, built_images: dict[str, Image], runtime: Runtime
) -> None:
    probe = (
        "import importlib.util as u; "
        "print([m for m in ('rljob.testing', 'rljob.emulator') if u.find_spec(m)])"
    )
    code, out = runtime.run(built_images[name], ["python3", "-c", probe])
    assert (code, out.strip()) == (0, "[]"), out
    code, out = runtime.run(built_images["testing"], ["python3", "-c", probe])
    assert (code, out.strip()) == (0, "['rljob.testing', 'rljob.emulator']"), out


def test_operator_image_starts_with_the_charts_tmp_only(
    built_images: dict[str, Image], runtime: Runtime
) -> None:
    """The chart gives the operator a read-only root and an emptyDir on /tmp (its HOME): enough to import
    and configure everything the operator runs, the `kubernetes` library's config loaders included (they
    write inline kubeconfig data to temporary files)."""
    script = (
        "import pathlib, kopf, kubernetes.config, rljob.controller.main, rljob.controller.handlers; "
        "pathlib.Path('/tmp/ok').write_text('1'); print('ok')"
    )
    code, out = runtime.run(built_images["operator"], ["python3", "-c", script], tmpfs=["/tmp"])
    assert (code, out.strip().splitlines()[-1:]) == (0, ["ok"]), out


def test_agent_image_serves_healthz_with_a_token_file_and_no_sglang(
    built_images: dict[str, Image], runtime: Runtime, tmp_path: Path
) -> None:
    """As the operator injects it: token from a read-only Secret volume, a read-only root, no /tmp; SGLang
    not there. /healthz answers (open), the API refuses a request without the token and takes it with."""
    token = secrets.token_urlsafe(24)
    secret = tmp_path / "agent-token"
    secret.mkdir()
    (secret / "token").write_text(token)
    secret.chmod(0o755)
    (secret / "token").chmod(0o444)
    port, nothing = free_port(), free_port()
    argv = [
        "rljob-agent", "--listen", f"127.0.0.1:{port}", "--trainer-listen", f"127.0.0.1:{free_port()}",
        "--engine-server-url", f"http://127.0.0.1:{nothing}", "--token-file", "/var/run/rljob/agent/token",
    ]  # fmt: skip
    agent = runtime.start(built_images["agent"], argv, binds=[Bind(secret, "/var/run/rljob/agent")])
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline and agent.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    health = (resp.status, json.loads(resp.read()))
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        assert health is not None, f"no /healthz answer; agent exited {agent.proc.poll()}:\n{agent.output()}"
        status, body = health
        assert status == 200 and set(body) >= {"ok", "stage"}, body
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/state", timeout=5)
        assert refused.value.code == 401
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/state", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200
    finally:
        agent.stop()


def test_image_sizes_stay_reasonable(built_images: dict[str, Image]) -> None:
    """Printed at the end of the run; bloat (a test world or a build tool in a product image) fails here."""
    limits_mb = {"operator": 400, "agent": 400, "testing": 500}
    for name, image in built_images.items():
        number, unit = image.size.split()
        size_mb = float(number) * {"kB": 1e-3, "MB": 1, "GB": 1e3}[unit]
        assert size_mb < limits_mb[name], f"{image.ref}: {image.size}"
