"""The rollout profile end to end (docs/profiling.md): two RLJobs whose simulated trainers differ get
different, correct diagnoses in status and in `kubectl rljob status` / `kubectl rljob profile`.

- "shared": many samples of few long prompts that share a prefix, one request in flight at a time: the
  emulated GPUs idle (8 running requests of the 64 that saturate them), nothing queues, the prefix cache
  hits -> RolloutConcurrency, and no other rollout lever.
- "unique": many short prompts with nothing in common, all sent at once to an SGLang that runs at most 16
  (--max-running-requests) and whose GPUs saturate at 8: the GPUs are busy, requests queue, nothing hits
  the cache -> RolloutCapacity first of the rollout levers, and PromptStructure; no RolloutConcurrency.

Levers about the handoff, the control plane or the trainer are left out of the comparison: on a loaded
2-core machine they depend on the load, which tests/unit/test_levers.py covers with fixed numbers.

A third job runs its SGLang without --enable-metrics: it completes, and its profile says which signals
were not measured (and why) instead of a 0 % hit rate, in status and in `kubectl rljob status` / `profile`.

The real operator, agents, SGLang emulators and simulated trainers, on a real API server."""

from __future__ import annotations

import copy
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.testing.harness import ROOT, OperatorProcess, get_rljob, phase_is, wait_rljob
from rljob.testing.kubeaccess import KubeApi, Kubectl, kubectl_env
from rljob.testing.pods import SIM_ARGS_ENV, rljob_mapping

pytestmark = pytest.mark.e2e

EXAMPLE = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
MODEL_BYTES = 16 << 30  # the emulator's default --weights-bytes: the decode roofline's bytes per step


@pytest.fixture
def operator(
    admin_kubeconfig: Path, rljob_crd: None, namespace: str, kubelet_factory: Any, tmp_path: Path
) -> Iterator[OperatorProcess]:
    kubelet_factory(mapping=rljob_mapping())
    proc = OperatorProcess(admin_kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield proc
    finally:
        proc.stop()


def profiled_job(name: str, trainer_args: str, sglang_args: str, sim_args: str) -> dict[str, Any]:
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec.update(iterations=3, podsAfterFinished="Keep", profile={"modelBytes": MODEL_BYTES})
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = spec["template"]["spec"]["containers"]
    sglang["args"] = [*sglang["args"], *shlex.split(sglang_args)]
    sglang["env"] = [*sglang.get("env", []), {"name": SIM_ARGS_ENV, "value": sim_args}]
    trainer["args"] = [*shlex.split(trainer_args), "--train-seconds", "0.1"]
    return manifest


SHARED = profiled_job(
    "shared",
    "--prompts 2 --samples-per-prompt 8 --prefix-tokens 256 --concurrency 1 --max-new-tokens 120",
    "",
    "--tokens-per-second 200 --saturation-batch 64",
)
UNIQUE = profiled_job(
    "unique",
    "--prompts 64 --samples-per-prompt 1 --prefix-tokens 0 --concurrency 64 --max-new-tokens 48",
    "--max-running-requests 16",
    "--tokens-per-second 200 --saturation-batch 8",
)


def without_metrics(manifest: dict[str, Any]) -> dict[str, Any]:
    """The job with its SGLang launched without --enable-metrics (examples/rljob.yaml passes it)."""
    sglang = manifest["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-metrics" in sglang["args"]
    sglang["args"] = [a for a in sglang["args"] if a != "--enable-metrics"]
    return manifest


# Prompts that share a prefix: the cache hits, but SGLang without --enable-metrics does not measure it.
NO_METRICS = without_metrics(
    profiled_job(
        "nometrics",
        "--prompts 2 --samples-per-prompt 4 --prefix-tokens 128 --concurrency 2 --max-new-tokens 60",
        "",
        "--tokens-per-second 200 --saturation-batch 64",
    )
)
SGLANG_METRICS_SIGNALS = {"cacheHitRate", "generationTokensPerSecond", "tokenCounts"}


ROLLOUT_LEVERS = (
    "RolloutConcurrency",
    "RunningRequestLimit",
    "RolloutCapacity",
    "RuntimeSpeed",
    "PromptStructure",
)


def levers(status: dict[str, Any]) -> list[str]:
    return [lv["lever"] for lv in status.get("diagnosis", [])]


def rollout_levers(status: dict[str, Any]) -> list[str]:
    """The diagnosis' rollout-side levers, in rank order. The others (Trainer, WeightHandoff,
    ControlOverhead) depend on how loaded this machine is, not on the trainer's workload."""
    return [lv for lv in levers(status) if lv in ROLLOUT_LEVERS]


def plugin_runner(kubectl: Kubectl, namespace: str) -> Callable[..., str]:
    """`kubectl rljob ...` as a user runs it (the plugin on PATH)."""
    env = kubectl_env(
        {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    )

    def plugin(*args: str) -> str:
        argv = [kubectl.binary, "rljob", f"--kubeconfig={kubectl.kubeconfig}", "-n", namespace, *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    return plugin


def test_two_trainers_get_two_diagnoses(
    operator: OperatorProcess,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    tmp_path: Path,
) -> None:
    kubectl.apply(SHARED, namespace=namespace)
    kubectl.apply(UNIQUE, namespace=namespace)
    done = {
        name: wait_rljob(
            kube_api,
            namespace,
            name,
            phase_is("Succeeded"),
            150,
            "Succeeded",
            on_timeout=operator.log_tail,
        )["status"]
        for name in ("shared", "unique")
    }
    shared, unique = done["shared"], done["unique"]
    for status in (shared, unique):
        assert status["profile"]["verdict"] != "TrainBound", status["lastIteration"]["seconds"]
        history = status["iterationHistory"]
        assert [r["iteration"] for r in history] == [1, 2, 3]
        last = status["lastIteration"]
        assert last == history[-1]
        assert last["gpus"] == 2 and last["samples"] > 0 and last["gpuSecondsPerSample"] > 0
        assert last["decodeRooflineTokensPerSecond"] > 0 and last["rooflineFraction"] > 0
        assert 0 < len(status["diagnosis"]) <= 5
        shares = [lv["share"] for lv in status["diagnosis"]]
        assert shares == sorted(shares, reverse=True)

    s = shared["lastIteration"]
    assert s["samples"] == 2 * 2 * 8  # two pods' trainers, each 2 prompts x 8 samples
    assert s["cacheHitRate"] > 0.8, s  # 7 of 8 samples reuse the prompt, prompts share 256 tokens
    assert s["gpuBusyFraction"] < 0.3, s  # 8 running of the 64 that saturate the emulated GPU
    assert s["meanWaitingRequests"] < 0.1 * s["meanRunningRequests"], s
    assert rollout_levers(shared) == ["RolloutConcurrency"], shared["diagnosis"]

    u = unique["lastIteration"]
    assert u["samples"] == 2 * 64
    assert u["cacheHitRate"] < 0.05, u  # no two prompts share a first token
    assert u["gpuBusyFraction"] >= 0.8, u
    assert u["meanWaitingRequests"] > 0.5 * u["meanRunningRequests"], u  # 48 of 64 queue behind 16 slots
    assert rollout_levers(unique)[0] == "RolloutCapacity", unique["diagnosis"]
    assert "PromptStructure" in rollout_levers(unique)
    assert "RolloutConcurrency" not in levers(unique) and "RunningRequestLimit" not in levers(unique)

    # Where users look: `kubectl rljob status` and `kubectl rljob profile` (kubectl finds the plugin on
    # PATH; it takes no kubectl flags before the plugin's name).
    plugin = plugin_runner(kubectl, namespace)
    shown = plugin("status", "shared")
    assert "Levers (largest share of the last iteration first):" in shown
    assert ". RolloutConcurrency (" in shown and "GPU busy" in shown and "RolloutCapacity" not in shown
    shown = plugin("status", "unique")
    assert (
        ". RolloutCapacity (" in shown
        and ". PromptStructure (" in shown
        and "RolloutConcurrency" not in shown
    )
    report = tmp_path / "unique.html"
    chart = plugin("profile", "unique", "--html", str(report))
    assert "Per-iteration profile (3 iterations on SGLang 0.5.23)" in chart and "RolloutCapacity" in chart
    page = report.read_text()
    assert page.count("<svg") == 4 and "<script" not in page and "RolloutCapacity" in page
    assert get_rljob(kube_api, namespace, "unique")["status"]["diagnosis"] == unique["diagnosis"]


def test_a_job_without_metrics_completes_and_says_what_was_not_measured(
    operator: OperatorProcess,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    tmp_path: Path,
) -> None:
    kubectl.apply(NO_METRICS, namespace=namespace)
    status = wait_rljob(
        kube_api,
        namespace,
        "nometrics",
        phase_is("Succeeded"),
        150,
        "Succeeded",
        on_timeout=operator.log_tail,
    )["status"]
    for report in status["iterationHistory"]:
        unmeasured = {u["signal"]: u for u in report.get("unmeasured", [])}
        assert set(unmeasured) >= SGLANG_METRICS_SIGNALS, report
        for signal in SGLANG_METRICS_SIGNALS:
            assert unmeasured[signal]["reason"] == "MetricsDisabled", unmeasured[signal]
            assert "--enable-metrics" in unmeasured[signal]["message"], unmeasured[signal]
        # absent, never the 0.0 SGLang reports without metrics; nor anything derived from them
        for key in ("cacheHitRate", "generationTokensPerSecond", "promptTokens", "rooflineFraction"):
            assert key not in report, (key, report)
        # what SGLang and the probe do measure without metrics is still there
        assert report["meanRunningRequests"] > 0 and report["gpuBusyFraction"] > 0, report
        assert report["samples"] > 0 and report["decodeRooflineTokensPerSecond"] > 0, report
    rollout = [s for s in status["timeline"] if s["phase"] == "Rollout" and s.get("rollout")]
    assert rollout and all("cacheHitRate" not in s and "tokensPerSecond" not in s for s in rollout), rollout
    assert not {"PromptStructure", "RuntimeSpeed"} & set(levers(status)), status["diagnosis"]

    plugin = plugin_runner(kubectl, namespace)
    shown = plugin("status", "nometrics")
    assert "prefix-cache hit rate not measured, generation not measured" in shown, shown
    assert "Not measured: prefix-cache hit rate, generation tokens/s, token counts (MetricsDisabled" in shown
    assert "hit rate 0%" not in shown
    page_path = tmp_path / "nometrics.html"
    chart = plugin("profile", "nometrics", "--html", str(page_path))
    assert "n/m, not measured: prefix-cache hit rate, generation tokens/s, token counts" in chart, chart
    page = page_path.read_text()
    assert "Not measured in the last iteration, so not judged" in page and 'class="nm"' in page
