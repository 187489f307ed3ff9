"""The GPU loop's kubelet mappings (rljob.testing.gpu_pods): on the GPU machine each container runs its own
command on this interpreter with the machine's GPU runtime variables; the CPU stand-in runs the emulator and
the simulated trainer instead, and only when asked for."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest

from rljob.api.spec import AGENT_CONTAINER
from rljob.testing.gpu_pods import gpu_runtime_env, machine_mapping, on_this_interpreter, stand_in_mapping
from rljob.testing.kubeaccess import KubeApi
from rljob.testing.kubelet import ContainerContext, Launch

POD_IP = "127.9.0.5"
SGLANG = {
    "name": "sglang",
    "command": ["python3", "-m", "sglang.launch_server"],
    "args": ["--model-path", "/weights/base", "--host", "127.0.0.1", "--port", "30000", "--enable-metrics"],
}
TRAINER = {
    "name": "trainer",
    "command": ["python3", "-m", "rljob.testing.model_trainer"],
    "args": ["--model-path", "/weights/base", "--gate-dir", "/weights/gate"],
}
AGENT = {
    "name": AGENT_CONTAINER,
    "command": ["rljob-agent"],
    "args": ["--engine-server-url", "http://127.0.0.1:30000"],
}


def context(container: dict[str, Any], tmp: Path, env: dict[str, str] | None = None) -> ContainerContext:
    mounts = {"/weights": tmp / "claim"}
    return ContainerContext({}, container, POD_IP, tmp, mounts, env or {}, cast(KubeApi, None))


def launch(mapping: Any, ctx: ContainerContext) -> Launch:
    out = mapping(ctx)
    assert isinstance(out, Launch)
    return out


def test_sglang_runs_its_own_command_on_this_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/triton-cache")
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("SECRET_TOKEN", "not for pods")
    got = launch(machine_mapping(), context(SGLANG, tmp_path, {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}))
    claim = str(tmp_path / "claim")
    assert list(got.argv) == [
        sys.executable, "-u", "-m", "sglang.launch_server", "--model-path", f"{claim}/base",
        "--host", POD_IP, "--port", "30000", "--enable-metrics",
    ]  # fmt: skip
    assert got.env["TRITON_CACHE_DIR"] == "/tmp/triton-cache" and got.env["CUDA_HOME"] == "/usr/local/cuda"
    assert got.env["SGLANG_ENABLE_METRICS_DEVICE_TIMER"] == "1" and "SECRET_TOKEN" not in got.env


def test_the_trainer_runs_its_own_command_and_the_agent_the_real_agent(tmp_path: Path) -> None:
    mapping = machine_mapping()
    trainer = launch(mapping, context(TRAINER, tmp_path, {"RLJOB_AGENT_URL": "http://127.0.0.1:8472"}))
    assert list(trainer.argv)[:4] == [sys.executable, "-u", "-m", "rljob.testing.model_trainer"]
    assert (
        f"{tmp_path}/claim/gate" in trainer.argv and trainer.env["RLJOB_AGENT_URL"] == f"http://{POD_IP}:8472"
    )
    agent = launch(mapping, context(AGENT, tmp_path))
    assert list(agent.argv) == [
        sys.executable, "-u", "-m", "rljob.agent.main", "--engine-server-url", f"http://{POD_IP}:30000",
    ]  # fmt: skip


def test_the_stand_in_runs_the_emulator_and_the_simulated_trainer(tmp_path: Path) -> None:
    mapping = stand_in_mapping(
        ["--tokens-per-second", "100"], ["--iterations", "3", "--gate-dir", "/weights/gate"]
    )
    sglang = launch(mapping, context(SGLANG, tmp_path))
    assert list(sglang.argv)[:4] == [sys.executable, "-u", "-m", "rljob.emulator"]
    assert list(sglang.argv)[-2:] == ["--tokens-per-second", "100"] and POD_IP in sglang.argv
    trainer = launch(mapping, context(TRAINER, tmp_path))
    assert list(trainer.argv) == [
        sys.executable, "-u", "-m", "rljob.testing.trainer", "--iterations", "3",
        "--gate-dir", f"{tmp_path}/claim/gate",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "replaced"),
    [(["python3", "-m", "x"], True), (["python", "x.py"], True), (["/usr/bin/python3.12", "-c", "1"], True),
     (["sh", "-c", "python3 x"], False), (["pythonista"], False)],
)  # fmt: skip
def test_only_a_python_command_changes_interpreter(argv: list[str], replaced: bool) -> None:
    got = on_this_interpreter(argv)
    assert (got[:2] == [sys.executable, "-u"] and got[2:] == argv[1:]) if replaced else got == argv


def test_gpu_runtime_env_keeps_the_gpu_runtime_only() -> None:
    host = {
        "CUDA_VISIBLE_DEVICES": "0",
        "LD_LIBRARY_PATH": "/x",
        "HF_HOME": "/h",
        "AWS_KEY": "k",
        "PYTORCH_X": "1",
    }
    assert gpu_runtime_env(host) == {"CUDA_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": "/x", "HF_HOME": "/h"}
