"""GPU tier: the real agent drives the SGLang emulator whose regions are real CUDA memory
(torch_memory_saver), or real SGLang, with a real torch trainer in between. Tests marked `gpu` are skipped
unless torch with a CUDA device, torch_memory_saver and NVML are all there (CI has none of them), and
once the run's deadline (RLJOB_GPU_TIMEOUT seconds from its start, less DEADLINE_MARGIN_S) has passed, so
that the figures and logs so far are written before the run is stopped."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))  # agent_procs: shared helpers

from agent_procs import PY, Agent, AgentDriver, Emulator, Proc
from gpu_helpers import cuda_missing
from real_models import Built8B

from rljob.testing.llama_checkpoint import ROOT_ENV, ShardedLlama

SESSION_STARTED = time.monotonic()
DEADLINE_MARGIN_S = 60.0  # a test that starts later than this before the deadline is skipped
BUILD_TIMEOUT_S = 600


@functools.cache
def gpu_missing() -> str | None:
    """Why the GPU tier cannot run here, or None. Creates no CUDA context."""
    if reason := cuda_missing():
        return reason
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        return "torch_memory_saver is not installed (pip install torch-memory-saver)"
    return None


def seconds_left() -> float | None:
    """Seconds to the run's deadline ($RLJOB_GPU_TIMEOUT from the start), None without one."""
    timeout = os.environ.get("RLJOB_GPU_TIMEOUT")
    return None if not timeout else float(timeout) - (time.monotonic() - SESSION_STARTED)


@pytest.fixture(autouse=True)
def _skip_without_gpu(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None:
        reason = gpu_missing()
        if reason:
            pytest.skip(f"GPU tier: {reason}")
        left = seconds_left()
        if left is not None and left < DEADLINE_MARGIN_S:
            pytest.skip(f"GPU tier: {left:.0f} s left of RLJOB_GPU_TIMEOUT, too little to start a test")


@pytest.fixture(scope="session")
def llama8b(tmp_path_factory: pytest.TempPathFactory) -> Built8B:
    """Built once per run, on the GPU, in a process of its own (python -m rljob.testing.llama_checkpoint),
    under $RLJOB_LLAMA_CHECKPOINT_ROOT when it is set (a base/ another test of the run wrote is reused),
    which then names it to the processes the tests start (llama_checkpoint.llama3_8b)."""
    reason = gpu_missing()
    if reason:
        pytest.skip(f"GPU tier: {reason}")
    given = os.environ.get(ROOT_ENV)
    root = Path(given) if given else tmp_path_factory.mktemp("llama3-8b")
    root.mkdir(parents=True, exist_ok=True)
    out = root / "build.json"
    cmd = [PY, "-m", "rljob.testing.llama_checkpoint", "--root", str(root), "--seeds", "0", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    build = json.loads(out.read_text())
    shards = [s for w in build["writes"] for s in w.get("shards", [w])]
    print(
        f"\nLlama-3-8B-shaped checkpoint: {build['bytes'] / 1e9:.2f} GB in {build['seconds']:.1f} s; "
        + "per shard "
        + "; ".join(
            f"{s['shard']} generate {s['generate_s']:.2f} s, to host {s['copy_s']:.2f} s, "
            f"write {s['write_s']:.2f} s"
            for s in shards
        )
    )
    os.environ[ROOT_ENV] = str(root)
    return Built8B(ShardedLlama(root), root / "v0", build)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Every process a test starts; all are stopped at teardown (which frees their GPU memory)."""
    started: list[Proc] = []
    yield started
    dead = [p for p in started if isinstance(p, Emulator) and not p.alive()]
    for p in reversed(started):
        p.stop()
    if dead:
        pytest.fail("SGLang emulator died during the test:\n" + dead[0].log_text()[-3000:])


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    """Where figures are written: $RLJOB_GPU_RESULTS_DIR if set (the device run points it at $OUT)."""
    import os

    d = Path(os.environ.get("RLJOB_GPU_RESULTS_DIR") or tmp_path / "results")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture
def start_gpu_emulator(procs: list[Proc], tmp_path: Path) -> Callable[..., Emulator]:
    """The emulator with `--memory-backend cuda`, LD_PRELOAD set for torch_memory_saver's hook (as SGLang's
    launcher sets it), graphs in the memory saver (SGLANG_MEMORY_SAVER_CUDA_GRAPH=1)."""

    def start(*flags: str, ready_timeout: float = 300, preload: bool = True, **kw: Any) -> Emulator:
        """preload=False: no LD_PRELOAD given; the emulator must re-execute itself with it."""
        from rljob.emulator.gpu_memory import preload_env

        env = preload_env({}) if preload else {}  # only variables to add: Proc merges them into os.environ
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
        # with it the default (breakable) prefill graph backend refuses to start (C-MEM-CUDAGRAPH-ENV)
        graphs = ("--cuda-graph-backend-prefill", "disabled")
        emu = Emulator(tmp_path, "0.5.23", "--memory-backend", "cuda", *graphs, *flags, env=env, **kw)
        procs.append(emu)
        emu.wait_ready(ready_timeout)
        return emu

    return start


@pytest.fixture
def start_nvml_agent(procs: list[Proc], tmp_path: Path) -> Callable[..., Agent]:
    """The real agent with `--gpu-probe nvml`, rollout opened (resume at the first epoch)."""

    def start(emulator: Emulator) -> Agent:
        agent = Agent(tmp_path, emulator.url, probe="nvml")
        procs.append(agent)
        agent.wait_stage("Ready", timeout=60)
        AgentDriver(agent).ok("resume")
        return agent

    return start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each phase's report on the item (`rep_call`...), for fixtures that act on how the test went."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
