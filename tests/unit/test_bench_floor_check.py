"""The control benchmark's own arithmetic: when it refuses to compare with its floor, and its projection."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_control_overhead.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_control_overhead", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def result(
    bench: ModuleType,
    floor_in_agent: float,
    run_in_agent: float,
    floor_busy: float,
    refit: float | None = None,
) -> object:
    """A 64-pod run whose floor ran every command of the cycle (the refit's in-agent time: `refit`)."""
    r = bench.SizeResult(pods=64, iterations=10, startup_seconds=1.0, window_seconds=10.0)
    r.in_agent = {phase: [run_in_agent] * 10 for phase in bench.TRANSITIONS}
    r.per_iteration = {"CPU operator": 0.1}  # 1 s over the window
    r.busy = 11.0  # 10 s of other load over 10 s: 1 core
    r.floor = [
        {"action": a, "wall": 0.05, "in_agent": refit if a == "refit" and refit else floor_in_agent}
        | {"patch": 0.01}
        for a in bench.FLOOR_OF.values()
    ]
    r.floor_cpu, r.floor_seconds, r.floor_busy = 1.0, 2.0, floor_busy
    return r


def test_a_floor_on_agents_as_fast_and_a_machine_as_loaded_is_compared(bench: ModuleType) -> None:
    assert bench.floor_refused(result(bench, 0.010, 0.009, 3.0), cores=2) is None  # 1 core of other load


def test_a_floor_whose_agents_were_slower_is_refused(bench: ModuleType) -> None:
    why = bench.floor_refused(result(bench, 0.030, 0.010, 3.0), cores=2)
    assert why is not None and why.startswith("drain in-agent 30.0 ms vs 10.0")


def test_in_agent_differences_within_a_scheduler_slice_are_noise(bench: ModuleType) -> None:
    assert bench.floor_refused(result(bench, 0.007, 0.013, 3.0), cores=2) is None


def test_a_floor_on_a_machine_loaded_otherwise_is_refused(bench: ModuleType) -> None:
    why = bench.floor_refused(result(bench, 0.010, 0.010, 5.0), cores=2)  # 2 cores of other load vs 1
    assert why is not None and why.startswith("load 2.00 cores vs 1.00")
    ratio = bench._ratio(0.05, result(bench, 0.010, 0.010, 5.0), 2, "Draining")
    assert ratio.startswith("no ratio: load")


def test_every_command_of_the_cycle_is_checked(bench: ModuleType) -> None:
    why = bench.floor_refused(result(bench, 0.100, 0.100, 3.0, refit=0.300), cores=2)
    assert why is not None and why.startswith("refit in-agent 300.0 ms vs 100.0")


def test_each_phase_is_compared_with_the_floor_of_its_own_command(bench: ModuleType) -> None:
    r = result(bench, 0.100, 0.100, 3.0)
    r.floor = [{**s, "wall": 0.2 if s["action"] == "resume" else 0.15} for s in r.floor]
    assert bench._ratio(0.2, r, 2, "Resuming") == "2.00x"  # 0.2 / (0.2 - 0.1)
    assert bench._ratio(0.2, r, 2, "Draining") == "4.00x"  # 0.2 / (0.15 - 0.1)
    assert bench._ratio(0.2, r, 2, "Training") == "4.00x"  # the grant's


def test_a_floor_saved_before_it_ran_every_command_is_read_as_one(bench: ModuleType) -> None:
    r = result(bench, 0.100, 0.100, 3.0)
    r.floor = [{**s, "wall": 0.15} for s in r.floor if s["action"] in ("drain", "resume")]
    assert bench.floor_refused(r, cores=2) is None
    assert bench._ratio(0.1, r, 2, "Refitting") == "2.00x"  # drain and resume together


def test_the_projection_fits_a_line_and_checks_it_against_larger_sizes(bench: ModuleType) -> None:
    assert bench.fit_line([(1, 3.0), (8, 10.0), (64, 66.0)]) == pytest.approx((2.0, 1.0))
    sized = []
    for pods in (64, 128, 512):
        r = bench.SizeResult(pods=pods, iterations=5, startup_seconds=1.0, window_seconds=5.0)
        r.per_iteration = {
            "CPU operator": 0.001 * pods, "API calls": 13.0, "status writes": 6.0,
            "agent reports": 7.0 * pods, "API request KiB": 1.0 + pods,
        }  # fmt: skip
        r.object_bytes, r.rss, r.rss_peak = 1024 * pods, 2**20 * 60, 2**20 * (60 + pods // 8)
        sized.append(r)
    table = "\n".join(bench.projection_table(sized, None))
    assert "| API calls | 13 + 0 x | 13 / 13 (1.00x) | 13 | 13 |" in table
    assert "| agent reports | " in table and "| 3.58e+03 / 3.58e+03 (1.00x) | 7.17e+03 | 2.87e+04 |" in table
    assert "fitted as a + b x pods on 64 and 128 pods" in table
    assert "| operator peak RSS MiB (VmHWM) | 60 + 0.125 x | 124 / 124 (1.00x) | 188 | 572 |" in table


@pytest.mark.parametrize(
    ("pods", "cores", "hosts"),
    [(1, 16, 1), (8, 16, 1), (64, 16, 8), (512, 16, 8), (800, 16, 8), (512, 64, 32), (64, 2, 8), (800, 2, 8)],
)
def test_hosts_up_to_one_per_two_cores(bench: ModuleType, pods: int, cores: int, hosts: int) -> None:
    assert bench.host_count(pods, cores) == hosts
