"""The GPUs of this pod, exactly (agent/gpu_scope.py, gpu_probe.NvmlProbe): which GPUs release verification
looks at, with a fake /proc and a fake NVML."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import pytest

from rljob.agent.gpu_probe import NvmlProbe
from rljob.agent.gpu_scope import GpuScopeUnknown, pod_gpu_lists, report_gpu_scope, select_gpus
from rljob.agent.state import StateStore
from rljob.api.agent import GpuScope
from rljob.controller.children import AGENT_CONTAINER, AgentOptions, gang_pod

UUIDS = [f"GPU-{i:04d}" for i in range(8)]  # a node of 8 GPUs


def proc(tmp: Path, pid: int, env: dict[str, str], files: dict[str, list[str]] | None = None) -> None:
    d = tmp / str(pid)
    d.mkdir(parents=True)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    for directory, names in (files or {}).items():
        target = d / "root" / directory.lstrip("/")
        target.mkdir(parents=True)
        for name in names:
            (target / name).write_text("")


def test_a_container_that_sees_only_the_pods_gpus_verifies_all_it_sees() -> None:
    for visible in (None, "GPU-0002,GPU-0005", "0,1"):  # a DRA claim's devices, or the plugin's list
        assert select_gpus(visible, None, []).scope == GpuScope.CONTAINER


def test_with_every_gpu_visible_the_pods_are_the_ones_sglang_was_given(tmp_path: Path) -> None:
    proc(tmp_path, 10, {"NVIDIA_VISIBLE_DEVICES": "GPU-0002,GPU-0005", "PATH": "/bin"})  # SGLang (envvar)
    proc(tmp_path, 11, {"NVIDIA_VISIBLE_DEVICES": "GPU-0002,GPU-0005"})  # one of its scheduler children
    proc(tmp_path, 12, {"NVIDIA_VISIBLE_DEVICES": "all"})  # the agent's own kind: not a list
    proc(tmp_path, 13, {"HOME": "/root"})  # a process without GPUs
    sel = select_gpus("all", None, pod_gpu_lists(tmp_path, own_pid=12))
    assert (sel.scope, sel.devices) == (GpuScope.PROCESS, ("GPU-0002", "GPU-0005"))


def test_the_device_plugins_volume_mounts_strategy_names_them_in_files(tmp_path: Path) -> None:
    proc(
        tmp_path,
        20,
        {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
        {"/var/run/nvidia-container-devices": ["GPU-0007", "GPU-0001"]},
    )
    sel = select_gpus("all", None, pod_gpu_lists(tmp_path, own_pid=1))
    assert sel.devices == ("GPU-0001", "GPU-0007")


def test_when_it_cannot_tell_it_says_so_instead_of_verifying_other_pods_gpus(tmp_path: Path) -> None:
    none = select_gpus("all", None, pod_gpu_lists(tmp_path, own_pid=1))  # no shared process namespace
    assert none.scope == GpuScope.UNKNOWN and "no process of this pod" in none.reason
    proc(tmp_path, 30, {"NVIDIA_VISIBLE_DEVICES": "GPU-0001"})
    proc(tmp_path, 31, {"NVIDIA_VISIBLE_DEVICES": "GPU-0003"})
    two = select_gpus("all", None, pod_gpu_lists(tmp_path, own_pid=1))
    assert two.scope == GpuScope.UNKNOWN and "different GPUs" in two.reason and "GPU-0003" in two.reason


def test_a_list_given_by_hand_wins() -> None:
    sel = select_gpus("all", "GPU-0004, GPU-0006", [(1, "GPU-0001")])
    assert (sel.scope, sel.devices) == (GpuScope.LISTED, ("GPU-0004", "GPU-0006"))


class FakeNvml(types.ModuleType):
    """pynvml with 8 GPUs; GPU 2 and 5 are this pod's SGLang's and hold 60 GiB each."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.opened: list[str] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(UUIDS)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        self.opened.append(UUIDS[i])
        return UUIDS[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.opened.append(uuid)
        return uuid

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> types.SimpleNamespace:
        used = 60 << 30 if handle in ("GPU-0002", "GPU-0005") else 1 << 30
        return types.SimpleNamespace(used=used, total=141 << 30)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_nvml_samples_only_the_gpus_sglang_uses(
    nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc(tmp_path, 40, {"NVIDIA_VISIBLE_DEVICES": "GPU-0002,GPU-0005"})
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    monkeypatch.delenv("RLJOB_GPU_UUIDS", raising=False)
    probe = NvmlProbe()
    probe.proc_root = tmp_path

    async def run() -> None:
        gpus = await probe.sample()
        assert [g.used_bytes for g in gpus] == [60 << 30, 60 << 30]  # never another pod's GPUs
        store = StateStore()
        report_gpu_scope(store, probe, len(gpus))
        assert store.state.gpus is not None
        assert (store.state.gpus.scope, store.state.gpus.devices) == (
            GpuScope.PROCESS,
            ["GPU-0002", "GPU-0005"],
        )

    asyncio.run(run())
    assert nvml.opened == ["GPU-0002", "GPU-0005"]


def test_nvml_refuses_to_sample_when_it_cannot_tell(
    nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    monkeypatch.delenv("RLJOB_GPU_UUIDS", raising=False)
    probe = NvmlProbe()
    probe.proc_root = tmp_path  # no process of the pod is visible

    async def run() -> None:
        with pytest.raises(GpuScopeUnknown, match="cannot tell which GPUs are this pod's"):
            await probe.sample()
        store = StateStore()
        report_gpu_scope(store, probe)
        assert store.state.gpus is not None and store.state.gpus.scope == GpuScope.UNKNOWN
        assert store.state.gpus.reason

    asyncio.run(run())
    assert nvml.opened == []


def test_the_operator_sets_every_gpu_visible_on_the_agent_only_when_asked() -> None:
    from test_topology import example_spec  # the examples' spec, as the topology tests build it

    from rljob.api import parse_spec

    spec = parse_spec(example_spec())

    def agent_env(options: AgentOptions) -> dict[str, str]:
        pod = gang_pod("rl", "u", spec, 0, 0, options, None)
        containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
        agent = next(c for c in containers if c["name"] == AGENT_CONTAINER)
        return {e["name"]: e.get("value", "") for e in agent["env"]}

    assert "NVIDIA_VISIBLE_DEVICES" not in agent_env(AgentOptions())  # the shared DRA claim gives the GPUs
    assert agent_env(AgentOptions(gpu_visibility="all"))["NVIDIA_VISIBLE_DEVICES"] == "all"
