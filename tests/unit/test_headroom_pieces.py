"""The headroom gate's pieces without processes: NVML's per-process structs as pynvml gives them, whose
process it is from a /proc tree, SGLang's size report, and what each resume needs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rljob.agent.engines.sglang.facts import SGLangFacts, reported_tag_bytes
from rljob.agent.errors import CommandFailed
from rljob.agent.gpu_holders import HOST_PIDS, NOT_IN_POD, attribute, describe
from rljob.agent.gpu_probe import GpuMemory, GpuProcessUse, NvmlProbe, processes_of
from rljob.agent.headroom import RESUME_MARGIN_BYTES, HeadroomGate, trainer_held
from rljob.agent.state import StateStore
from rljob.api.agent import GpuProcess
from rljob.api.spec import ReleaseTag

GiB = 1 << 30
KV, WEIGHTS, GRAPHS = (
    [ReleaseTag.KV_CACHE],
    [ReleaseTag.CUDA_GRAPH, ReleaseTag.WEIGHTS],
    [ReleaseTag.CUDA_GRAPH],
)


def nvml_proc(pid: int, used: int | None) -> SimpleNamespace:
    """What pynvml's nvmlDeviceGetComputeRunningProcesses returns per process: a struct with `pid` and
    `usedGpuMemory`, None where NVML reports NVML_VALUE_NOT_AVAILABLE (and the MIG instance ids)."""
    return SimpleNamespace(
        pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
    )


def test_nvml_structs_one_entry_per_process() -> None:
    listed = [
        nvml_proc(41, 3 * GiB),
        nvml_proc(7, None),
        nvml_proc(41, GiB),
        nvml_proc(9, None),
        nvml_proc(9, 5),
    ]
    assert processes_of(2, listed) == [
        GpuProcessUse(2, 7, None),  # NVML cannot tell: kept as unknown, never 0
        GpuProcessUse(2, 9, 5),  # in both lists: the figure NVML has
        GpuProcessUse(2, 41, 3 * GiB),  # compute and graphics: the larger
    ]


class FakeNvml:
    """pynvml's names, for NvmlProbe on two GPUs: compute and graphics lists, graphics unsupported on 1."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.compute = {0: [nvml_proc(100, 2 * GiB)], 1: [nvml_proc(100, GiB), nvml_proc(200, None)]}

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return self.compute[h]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        if h == 1:
            raise self.NVMLError("Not Supported")
        return [nvml_proc(300, GiB)]


def test_nvml_probe_lists_the_pods_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("RLJOB_GPU_UUIDS", raising=False)
    probe = NvmlProbe()
    fake = FakeNvml()
    monkeypatch.setattr(NvmlProbe, "_init_locked", lambda self: _start(self, fake))
    assert probe.host_pids
    assert asyncio.run(probe.processes()) == [
        GpuProcessUse(0, 100, 2 * GiB),
        GpuProcessUse(0, 300, GiB),
        GpuProcessUse(1, 100, GiB),
        GpuProcessUse(1, 200, None),
    ]


def _start(probe: NvmlProbe, fake: FakeNvml) -> None:
    probe._handles = probe._own_handles(fake)
    probe._names = ["NVIDIA H100 80GB HBM3"] * len(probe._handles)
    probe._since = [0] * len(probe._handles)
    probe._nvml = fake


def proc_tree(root: Path, pid: int, env: dict[str, str] | None, maps: str | None = "") -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    if env is not None:
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    if maps is not None:
        (d / "maps").write_text(maps)


def test_attribution_by_the_containers_name(tmp_path: Path) -> None:
    gpu_maps = "7f0000000000-7f0000001000 rw-s 00000000 00:05 12 /dev/nvidiactl\n"
    proc_tree(tmp_path, 17, {"RLJOB_CONTAINER": "trainer"}, gpu_maps)
    proc_tree(tmp_path, 23, {"PATH": "/bin"}, gpu_maps)
    proc_tree(tmp_path, 31, {"RLJOB_CONTAINER": "sidecar"}, "7f00-7f01 r-xp 0 00:05 1 /usr/bin/python3\n")
    proc_tree(tmp_path, 37, None, gpu_maps)  # environ unreadable (another user's process)
    listed = [GpuProcessUse(0, pid, GiB) for pid in (17, 23, 31, 37, 4121)]
    # A probe whose pids are the agent's own (the emulator's): what /proc shows is the process.
    own = {p.pid: p for p in attribute(listed, host_pids=False, proc_root=tmp_path)}
    assert own[17].container == "trainer" and own[17].not_attributable is None
    assert own[23].container is None and "names no container (RLJOB_CONTAINER)" in str(
        own[23].not_attributable
    )
    assert own[31].container == "sidecar"
    assert own[37].container is None and "not readable" in str(own[37].not_attributable)
    assert own[4121].not_attributable == NOT_IN_POD
    # NVML's pids are the host's: a pid here is the same process only if it maps a GPU device.
    host = {p.pid: p for p in attribute(listed, host_pids=True, proc_root=tmp_path)}
    assert host[17].container == "trainer"
    assert host[31].container is None and host[31].not_attributable == HOST_PIDS
    assert host[4121].not_attributable == HOST_PIDS


def test_what_a_holder_and_a_kept_trainer_read_like(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLJOB_TRAINER_CONTAINER", raising=False)
    trainer = GpuProcess(gpu=1, pid=4121, used_bytes=int(17.2 * GiB), container="trainer")
    other = GpuProcess(gpu=0, pid=9, used_bytes=None, not_attributable="why")
    assert describe(trainer) == "pid 4121 (trainer) holds 17.2 GiB"
    assert describe(other) == "pid 9 (not attributable: why) holds an amount NVML cannot tell"
    context = GpuProcess(gpu=0, pid=4121, used_bytes=600 << 20, container="trainer")  # its CUDA context
    assert trainer_held([context, other]) is None
    assert trainer_held([trainer]) == "pid 4121 (trainer) holds 17.2 GiB on GPU 1 after returning its lease"
    monkeypatch.setenv("RLJOB_TRAINER_CONTAINER", "learner")
    assert trainer_held([trainer]) is None


def usage(weight: float, kv: float, graph: Any) -> dict[str, Any]:
    return {"weight": weight, "kvcache": kv, "graph": graph, "token_capacity": 1000}


def test_sglangs_size_report_in_both_layouts() -> None:
    old = {"internal_states": [{"memory_usage": usage(16.0, 36.5, 1.25)}]}
    assert reported_tag_bytes(old) == {
        "weights": 16 * GiB,
        "kv_cache": int(36.5 * GiB),
        "cuda_graph": int(1.25 * GiB),
    }
    phases = {"prefill": 0.0, "decode": 1.5, "target_verify": 0.25}
    new = {
        "internal_states": [
            {"memory_usage": usage(16.0, 30.0, phases)},
            {"memory_usage": usage(16.5, 30.0, phases)},
        ]
    }
    assert reported_tag_bytes(new) == {
        "weights": int(16.5 * GiB),
        "kv_cache": 30 * GiB,
        "cuda_graph": int(1.75 * GiB),
    }
    # Unreported or unreadable on a rank: that tag is left to the measurement.
    partial = {"internal_states": [{"memory_usage": {"weight": 16.0, "kvcache": "n/a"}}, {}]}
    assert reported_tag_bytes(partial) == {}
    assert reported_tag_bytes({"internal_states": [{"memory_usage": {"weight": 2.0}}]}) == {
        "weights": 2 * GiB
    }
    assert reported_tag_bytes({}) == {}
    facts = SGLangFacts.from_server_info({"version": "0.5.23", **old})
    assert dict(facts.tag_bytes)["kv_cache"] == int(36.5 * GiB)


class Probe:
    host_pids = False

    def __init__(self, used: list[int], total: int = 80 * GiB) -> None:
        self.used, self.total = used, total
        self.listed: list[GpuProcessUse] = []

    async def sample(self) -> list[GpuMemory]:
        return [GpuMemory(i, u, self.total) for i, u in enumerate(self.used)]

    async def processes(self) -> list[GpuProcessUse]:
        return self.listed

    async def utilization(self) -> list[float] | None:
        return None


def gate(
    probe: Probe,
    freed: dict[int, int],
    sizes: dict[str, int] | None = None,
    proc: Path = Path("/nonexistent"),
) -> tuple[HeadroomGate, StateStore]:
    store = StateStore()
    store.facts = SGLangFacts("0.5.23", "off", True, False, 1, tag_bytes=tuple(sorted((sizes or {}).items())))
    store.release_freed = dict(freed)
    return HeadroomGate(store, probe, probe.sample, proc), store  # type: ignore[arg-type]


def test_each_resume_needs_what_the_release_freed_less_what_came_back() -> None:
    """One release freed weights, graphs and KV together (56 GiB on each GPU): the refit's resume takes
    SGLang's size of weights and graphs, the resume after it what is left, measured."""
    probe = Probe([4 * GiB, 4 * GiB])
    g, store = gate(
        probe, {0: 56 * GiB, 1: 55 * GiB}, {"weights": 16 * GiB, "kv_cache": 40 * GiB, "cuda_graph": 2 * GiB}
    )
    assert g.need(WEIGHTS) == {0: 18 * GiB, 1: 18 * GiB}
    g.took_back(
        [GpuMemory(0, 4 * GiB, 0), GpuMemory(1, 4 * GiB, 0)],
        [GpuMemory(0, 20 * GiB, 0), GpuMemory(1, 21 * GiB, 0)],
    )
    assert store.taken_back == {0: 16 * GiB, 1: 17 * GiB}
    assert g.need(KV) == {0: 40 * GiB, 1: 38 * GiB}  # no more than is left of what the release freed
    # Without SGLang's sizes NVML cannot split the release: the first resume waits for room for all of it.
    g, _ = gate(probe, {0: 56 * GiB})
    assert g.need(WEIGHTS) == {0: 56 * GiB}
    # A tag SGLang did not report: the measured figure alone.
    g, _ = gate(probe, {0: 56 * GiB}, {"weights": 16 * GiB})
    assert g.need(GRAPHS) == {0: 56 * GiB}


def test_the_gate_waits_names_and_fails_at_the_deadline(tmp_path: Path) -> None:
    probe = Probe([50 * GiB])
    probe.listed = [GpuProcessUse(0, 4121, 30 * GiB), GpuProcessUse(0, 88, 20 * GiB)]
    proc_tree(tmp_path, 4121, {"RLJOB_CONTAINER": "trainer"})
    g, store = gate(probe, {0: 40 * GiB}, proc=tmp_path)
    left = iter([1.0, 0.0])
    with pytest.raises(CommandFailed) as failed:
        asyncio.run(g.clear(KV, 7, lambda: next(left)))
    assert str(failed.value) == (
        "GPU 0: pid 4121 (trainer) holds 30.0 GiB, pid 88 (not attributable: no process of this pid in the "
        "agent's PID namespace (another pod's, or a host process)) holds 20.0 GiB; the resume of kv_cache "
        "needs 40.0 GiB (+0.5 GiB margin), 30.0 GiB free; not resumed: not free within the command's deadline"
    )
    h = store.state.headroom
    assert h is not None and h.epoch == 7 and not h.waiting and h.message and h.waited_seconds > 0
    assert h.trainer_held == "pid 4121 (trainer) holds 30.0 GiB on GPU 0 after returning its lease"
    assert [(x.gpu, x.need_bytes, x.free_bytes) for x in h.gpus] == [(0, 40 * GiB, 30 * GiB)]
    # Exactly the need and the margin free: sent.
    probe.used = [80 * GiB - 40 * GiB - RESUME_MARGIN_BYTES]
    assert asyncio.run(g.clear(KV, 8, lambda: 1.0)) == [GpuMemory(0, probe.used[0], 80 * GiB)]
    h = store.state.headroom
    assert h is not None and h.epoch == 8 and not h.waiting and h.message is None and h.waited_seconds == 0
