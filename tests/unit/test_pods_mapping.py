"""What the fake kubelet runs for an RLJob pod's containers (rljob.testing.pods): a vLLM container, however
it launches vLLM, becomes the vLLM emulator with that container's own `vllm serve` flags, at the version
its image names."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest

from rljob.testing.kubeaccess import KubeApi
from rljob.testing.kubelet import ContainerContext, Launch
from rljob.testing.pods import SIM_ARGS_ENV, classify, rljob_mapping

POD_IP = "127.9.0.6"
SERVE = ["/weights/base", "--host", "127.0.0.1", "--port", "8000", "--enable-sleep-mode"]


def context(container: dict[str, Any], tmp: Path, env: dict[str, str] | None = None) -> ContainerContext:
    return ContainerContext(
        {}, container, POD_IP, tmp, {"/weights": tmp / "claim"}, env or {}, cast(KubeApi, None)
    )


@pytest.mark.parametrize(
    "container",
    [
        {"name": "vllm", "image": "vllm/vllm-openai:v0.26.0", "command": ["vllm", "serve"], "args": SERVE},
        {"name": "rollout", "image": "vllm/vllm-openai:v0.26.0", "command": ["vllm", "serve", *SERVE]},
        {
            "name": "vllm",
            "image": "registry.example/vllm/vllm-openai:v0.26.0",
            "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
            "args": SERVE,
        },
        {"name": "vllm", "image": "vllm/vllm-openai:v0.26.0", "args": SERVE},  # the image's entrypoint
    ],
    ids=["vllm-serve", "one-command", "module", "image-entrypoint"],
)
def test_a_vllm_container_runs_the_vllm_emulator_with_its_flags(
    container: dict[str, Any], tmp_path: Path
) -> None:
    got = rljob_mapping()(context(container, tmp_path))
    assert isinstance(got, Launch)
    claim = str(tmp_path / "claim")
    assert list(got.argv) == [
        sys.executable, "-u", "-m", "rljob.emulator.vllm", "--vllm-version", "0.26.0",
        f"{claim}/base", "--host", POD_IP, "--port", "8000", "--enable-sleep-mode",
    ]  # fmt: skip


def test_the_version_comes_from_the_image_and_the_emulator_flags_last(tmp_path: Path) -> None:
    newest = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.34.0",
        "command": ["vllm", "serve"],
        "args": SERVE,
    }
    assert classify(context(newest, tmp_path)).args[:2] == ["--vllm-version", "0.34.0"]
    untagged = {**newest, "image": "vllm/vllm-openai"}
    assert classify(context(untagged, tmp_path)).args[:2] == ["--vllm-version", "0.26.0"]  # the default
    env = {SIM_ARGS_ENV: "--tokens-per-second 0 --vllm-version 0.34.0"}
    c = classify(context(untagged, tmp_path, env))
    assert c.kind == "vllm" and c.args[-4:] == ["--tokens-per-second", "0", "--vllm-version", "0.34.0"]


def test_other_images_and_commands_are_not_vllm(tmp_path: Path) -> None:
    for container in (
        {"name": "vllm", "image": "busybox", "command": ["sh", "-c", "echo vllm serve"]},
        {"name": "x", "image": "example/vllm-openai-tools:1", "args": ["serve"]},
        {"name": "x", "image": "vllm/vllm-openai:v0.26.0", "command": ["bash"], "args": ["-c", "true"]},
    ):
        assert classify(context(container, tmp_path)).kind == "other", container
