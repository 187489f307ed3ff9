"""The operator's whole loop on one GPU node, for test_operator_loop.py.

`Loop.start` brings up a real control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager),
installs the chart (CRD, ServiceAccount, RBAC) with real helm, runs the operator as the chart's
ServiceAccount, and a fake kubelet with one node of one `nvidia.com/gpu` that runs each pod's containers on
this machine (rljob.testing.gpu_pods): the real agent, the `sglang` container's own command (real SGLang)
and the trainer's own command (rljob.testing.model_trainer, torch). With RLJOB_GPU_LOOP_STAND_IN=emulator
the SGLang emulator and the simulated trainer stand in for SGLang and torch, to prove this harness on a
machine without a GPU (tests/gpu/README.md); nothing else changes.

`Loop.run_job` applies an RLJob of one pod with `kubectl apply -f`, prints its phases as they end, and reads
SGLang's own `/metrics` at each rollout's edges (rljob.testing.rollout_gate): the agent's figures are
compared with those in `compare`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from real_sglang import LAUNCH_FLAGS, VERSION

from rljob.testing.cluster import K8S_VERSION, LocalControlPlane, cached_binaries
from rljob.testing.gpu_models import MODEL_VARS
from rljob.testing.gpu_pods import machine_mapping, stand_in_mapping
from rljob.testing.harness import OperatorProcess, get_rljob
from rljob.testing.install import install_chart, operator_kubeconfig
from rljob.testing.kubeaccess import KubeApi, Kubectl, create_namespace, kubectl_env
from rljob.testing.kubelet import Kubelet, NodeShape
from rljob.testing.rollout_gate import GateKeeper

STAND_IN_ENV = "RLJOB_GPU_LOOP_STAND_IN"  # "emulator": the CPU stand-in; unset: real SGLang and torch
SOURCES_ENV = "RLJOB_GPU_LOOP_SOURCES"  # the refit sources to run a job for, in order
NAMESPACE = "gpu-loop"
CHART_NAMESPACE = "rljob-system"
ITERATIONS = 3
SEED_BASE = 100  # version v's weights are the model's of seed 100 + v
# One rollout: 4 prompts sharing a 64-word prefix, 2 samples each, all 8 requests in flight at once (the
# decode batch the tier's CUDA graphs cover: --cuda-graph-max-bs-decode 8).
ROLLOUT_ARGS = (
    "--prompts", "4", "--samples-per-prompt", "2", "--prefix-tokens", "64", "--max-new-tokens", "128",
    "--concurrency", "4", "--timeout", "600",
)  # fmt: skip
GATE = "/weights/gate"
# The emulator's speed in the stand-in: a rollout of 128 tokens per request lasts about a second.
EMULATOR_ARGS = ("--sglang-version", VERSION, "--tokens-per-second", "150", "--saturation-batch", "32")

# The counters compared, as SGLang names them (C-METRIC-PROM, C-METRIC-DEVICE-TIMER).
PROMPT, CACHED, GENERATED = (
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:generation_tokens_total",
)
FORWARD = ("sglang:forward_execution_seconds_total", "sglang:gpu_execution_seconds_total")


def stand_in() -> bool:
    """True when the emulator and the simulated trainer stand in; any other value than `emulator` is an
    error, never a silent choice."""
    value = os.environ.get(STAND_IN_ENV, "")
    if value not in ("", "emulator"):
        raise ValueError(f"{STAND_IN_ENV}={value!r}: only 'emulator' (or unset, for real SGLang) is known")
    return value == "emulator"


def missing_binaries() -> list[str]:
    return [str(p) for p in vars(cached_binaries()).values() if not os.access(p, os.X_OK)]


class Deadline:
    """RLJOB_GPU_TIMEOUT seconds from the session's start, less a margin for teardown and results."""

    def __init__(self, started: float, margin: float = 25.0) -> None:
        total = os.environ.get("RLJOB_GPU_TIMEOUT")
        self.at = started + float(total) - margin if total else None

    def left(self, wanted: float) -> float:
        return wanted if self.at is None else max(0.0, min(wanted, self.at - time.monotonic()))


def say(text: str) -> None:
    print(text, flush=True)


def scrape(url: str) -> dict[str, float]:
    """SGLang's /metrics: each sample name's value summed over its label sets (the text format: `name{labels}
    value`, comments skipped)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{\s]", line, maxsplit=1)[0]
        value = line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1]
        sums[name] = sums.get(name, 0.0) + float(value)
    return sums


@dataclass
class Edges:
    """SGLang's /metrics as the test read it at each rollout edge: (iteration, edge) -> (monotonic, sums)."""

    url: Callable[[], str]
    seen: dict[tuple[int, str], tuple[float, dict[str, float]]] = field(default_factory=dict)

    def on_edge(self, iteration: int, edge: str) -> None:
        sums = scrape(self.url())
        self.seen[(iteration, edge)] = (time.monotonic(), sums)

    def window(self, iteration: int) -> tuple[float, dict[str, float]]:
        """The test's window of `iteration`: its seconds and each sample's increase over it."""
        t0, start = self.seen[(iteration, "start")]
        t1, end = self.seen[(iteration, "end")]
        return t1 - t0, {k: end[k] - start.get(k, 0.0) for k in end}


def loop_rljob(name: str, source: str, model: str) -> dict[str, Any]:
    """An RLJob of one pod on one GPU: the `sglang` container launches real SGLang with the tier's flags
    (real_sglang.LAUNCH_FLAGS: memory saver, metrics) and its device timer on, the trainer container runs
    rljob.testing.model_trainer; both see the job's volume at /weights (the launch checkpoint at
    /weights/base)."""
    trainer_args = [
        "--model-path", "/weights/base", "--model", model, "--seed-base", str(SEED_BASE),
        "--iterations", str(ITERATIONS), *ROLLOUT_ARGS, "--gate-dir", GATE,
    ]  # fmt: skip
    return {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "iterations": ITERATIONS,
            "podsAfterFinished": "Keep",  # the test checks the served weights after Succeeded
            "refit": {"source": source},
            "weights": {"initialVersion": "0", "initialPath": "/weights/base"},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "sglang",
                            "image": f"lmsysorg/sglang:v{VERSION}",
                            "command": ["python3", "-m", "sglang.launch_server"],
                            "args": [
                                "--model-path",
                                "/weights/base",
                                "--host",
                                "127.0.0.1",
                                "--port",
                                "30000",
                                *LAUNCH_FLAGS,
                            ],
                            # SGLang's own GPU busy: forward-pass seconds in /metrics (C-METRIC-DEVICE-TIMER)
                            "env": [{"name": "SGLANG_ENABLE_METRICS_DEVICE_TIMER", "value": "1"}],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                            "volumeMounts": [{"name": "weights", "mountPath": "/weights"}],
                        },
                        {
                            "name": "trainer",
                            "image": "ghcr.io/rljob/rljob-testing:0.1.0",
                            "command": ["python3", "-m", "rljob.testing.model_trainer"],
                            "args": trainer_args,
                            "env": [{"name": "RLJOB_WEIGHTS_DIR", "value": "/weights"}, *model_vars()],
                            "volumeMounts": [{"name": "weights", "mountPath": "/weights"}],
                        },
                    ],
                    "volumes": [
                        {"name": "weights", "persistentVolumeClaim": {"claimName": f"{name}-weights"}}
                    ],
                }
            },
        },
    }


def model_vars() -> list[dict[str, str]]:
    """The variables the models read (gpu_models.MODEL_VARS), as the trainer container's env."""
    return [{"name": n, "value": os.environ[n]} for n in MODEL_VARS if n in os.environ]


def stand_in_trainer_args() -> list[str]:
    """The simulated trainer's flags for the same workload (model_trainer's rollout flags are its own)."""
    return ["--iterations", str(ITERATIONS), *ROLLOUT_ARGS, "--gate-dir", GATE]


def _nvml_used() -> int:
    import pynvml

    pynvml.nvmlInit()
    return sum(
        int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
        for i in range(pynvml.nvmlDeviceGetCount())
    )


@dataclass
class Job:
    name: str
    source: str
    claim: Path
    manifest_file: Path
    edges: Edges
    final: dict[str, Any] = field(default_factory=dict)
    phases_seconds: float = 0.0  # from kubectl apply to Succeeded or Failed
    serving_after: float = 0.0  # from kubectl apply to the first rollout


class Loop:
    def __init__(self, work: Path, model: str, launch: Path, deadline: Deadline) -> None:
        self.work, self.model, self.launch, self.deadline = work, model, launch, deadline
        self.stand_in = stand_in()
        self.plane: LocalControlPlane | None = None
        self.kubelet: Kubelet | None = None
        self.operator: OperatorProcess | None = None
        self.gpu_used_at_start = 0

    # --- the world ---------------------------------------------------------------------------------

    def start(self) -> Loop:
        t0 = time.monotonic()
        binaries = cached_binaries()
        self.plane = LocalControlPlane(self.work / "cluster", binaries)
        self.plane.start()
        self.api = KubeApi.from_kubeconfig(self.plane.kubeconfig)
        self.kubectl = Kubectl(self.plane.kubeconfig)
        say(f"== control plane up in {time.monotonic() - t0:.1f} s: etcd, kube-apiserver, kube-scheduler, "
            f"kube-controller-manager {K8S_VERSION} ({self.plane.server})")  # fmt: skip
        say(self.kubectl("version").stdout.strip())
        create_namespace(self.api, NAMESPACE)
        probe = "rljob.emulator.probe:EmulatorProbe" if self.stand_in else "nvml"
        say(f"== helm upgrade --install rljob charts/rljob-operator -n {CHART_NAMESPACE} ({probe} probe)")
        installed = install_chart(binaries.helm, self.plane.kubeconfig, "rljob", CHART_NAMESPACE, [NAMESPACE],
                                  extra_values={"agent": {"gpuProbe": probe}})  # fmt: skip
        say("\n".join(installed.strip().splitlines()[:17]))  # up to the chart's summary of what it set up
        operator_config = operator_kubeconfig(
            self.api, self.plane, CHART_NAMESPACE, self.work / "operator.kubeconfig"
        )
        if self.stand_in:
            mapping = stand_in_mapping(EMULATOR_ARGS, stand_in_trainer_args())
            say("== STAND-IN: the SGLang emulator and the simulated trainer run for SGLang and torch "
                f"({STAND_IN_ENV}=emulator)")  # fmt: skip
        else:
            mapping = machine_mapping()
            self.gpu_used_at_start = _nvml_used()
        shape = NodeShape(gpus=1, cpu=str(os.cpu_count() or 1), memory="128Gi")
        self.kubelet = Kubelet(
            self.plane.kubeconfig, [NAMESPACE], mapping, nodes=1, shape=shape, node_prefix="gpu-node",
            scratch_root=self.work / "pods", pod_hosts=False,
        ).start()  # fmt: skip
        self.operator = OperatorProcess(
            operator_config, [NAMESPACE], self.work / "operator.log", agent_gpu_probe=probe
        ).start()
        self.plugin_path = self._plugin_shim()
        say(f"== operator as ServiceAccount {CHART_NAMESPACE}/rljob-operator; fake kubelet: node gpu-node-0 "
            f"with 1 nvidia.com/gpu; ready in {time.monotonic() - t0:.1f} s")  # fmt: skip
        say(self.kubectl("get", "nodes", "-o", "wide").stdout.rstrip())
        return self

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.plane is not None:
            self.plane.stop()

    def _plugin_shim(self) -> Path:
        """`kubectl-rljob` on PATH, as the package's console script installs it: this interpreter."""
        bin_dir = self.work / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        shim = bin_dir / "kubectl-rljob"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rljob.cli.kubectl_plugin "$@"\n')
        shim.chmod(0o755)
        return bin_dir

    def kubectl_user(self, *args: str) -> str:
        """kubectl as a user runs it (the server's release, the plugin on PATH); fails on a non-zero exit."""
        env = kubectl_env({**os.environ, "PATH": f"{self.plugin_path}{os.pathsep}{os.environ['PATH']}"})
        env["KUBECONFIG"] = str(self.kubectl.kubeconfig)  # a plugin takes no kubectl flag before its name
        argv = [self.kubectl.binary, *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}{done.stdout}"
        return done.stdout

    # --- one job -----------------------------------------------------------------------------------

    def claim_dir(self, name: str) -> Path:
        """Where the fake kubelet keeps the job's claim (kubelet.materialise_volumes)."""
        return self.work / "pods" / NAMESPACE / "claims" / f"{name}-weights"

    def pod(self, name: str) -> dict[str, Any]:
        pods = self.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector=f"rljob.io/job={name}")
        assert len(pods["items"]) == 1, [p["metadata"]["name"] for p in pods["items"]]
        return dict(pods["items"][0])

    def sglang_url(self, name: str) -> str:
        return f"http://{self.pod(name)['status']['podIP']}:30000"

    def prepare(self, source: str, results: Path) -> Job:
        name = f"loop-{source}"
        claim = self.claim_dir(name)
        claim.mkdir(parents=True, exist_ok=True)
        (claim / "base").symlink_to(self.launch, target_is_directory=True)
        manifest = loop_rljob(name, source, self.model)
        manifest_file = results / f"operator_loop_{name}.yaml"
        manifest_file.write_text(
            yaml.safe_dump(manifest, sort_keys=False, default_flow_style=None, width=110)
        )
        url: dict[str, str] = {}

        def sglang() -> str:
            if "url" not in url:
                url["url"] = self.sglang_url(name)
            return url["url"]

        return Job(name, source, claim, manifest_file, Edges(sglang))

    def run_job(self, job: Job, timeout: float) -> dict[str, Any]:
        """kubectl apply, then the phases as they end until Succeeded or Failed; the final RLJob."""
        say(f"\n== kubectl apply -f {job.manifest_file.name}  (RLJob {job.name}: 1 pod, {ITERATIONS} "
            f"iterations, refit.source {job.source})\n{job.manifest_file.read_text()}")  # fmt: skip
        keeper = GateKeeper(job.claim / "gate", job.edges.on_edge).start()
        started = time.monotonic()
        try:
            say(self.kubectl_user("apply", "-n", NAMESPACE, "-f", str(job.manifest_file)).strip())
            job.final = self._follow(job, started, self.deadline.left(timeout))
        finally:
            keeper.stop()
        job.phases_seconds = time.monotonic() - started
        assert not keeper.errors, f"reading SGLang's /metrics at a rollout edge failed: {keeper.errors}"
        return job.final

    def _follow(self, job: Job, started: float, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        printed: set[tuple[str, str]] = set()
        placed = False
        say("ITER  PHASE        WALL-ms  AGENT-ms  NOTE")
        obj: dict[str, Any] = {}
        while time.monotonic() < deadline:
            obj = get_rljob(self.api, NAMESPACE, job.name)
            status = obj.get("status") or {}
            if not placed:
                pods = self.api.get(
                    f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector=f"rljob.io/job={job.name}"
                )
                bound = [p for p in pods["items"] if p["spec"].get("nodeName")]
                if bound:
                    placed = True
                    pod, node = bound[0]["metadata"]["name"], bound[0]["spec"]["nodeName"]
                    say(f"      pod {pod} bound to {node} by kube-scheduler")
            spans = status.get("timeline") or []
            if not job.serving_after and any(s["phase"] == "Rollout" for s in spans):
                job.serving_after = time.monotonic() - started
            for at, span in enumerate(spans):
                key = (span["phase"], span["startTime"])
                if span.get("seconds") is None or key in printed:
                    continue
                if span["phase"] == "Rollout" and (
                    at + 1 == len(spans) or spans[at + 1].get("seconds") is None
                ):
                    continue  # its figures are final once the drain's last sample is in: at Draining's end
                printed.add(key)
                agent = (
                    f"{span['agentSeconds'] * 1000:8.0f}"
                    if span.get("agentSeconds") is not None
                    else "       -"
                )
                note = ""
                if span.get("freedBytes"):
                    note = f"freed {span['freedBytes'] / 2**30:.2f} GiB"
                if span.get("cacheHitRate") is not None:
                    tps = span.get("tokensPerSecond") or 0
                    note = f"prefix-cache hit {span['cacheHitRate']:.0%}, {tps:.0f} tok/s"
                wall = span["seconds"] * 1000
                say(f"{span['iteration']:>4}  {span['phase']:11} {wall:8.0f}  {agent}  {note}")
            if status.get("phase") in ("Succeeded", "Failed"):
                say(f"{status['phase']}: {status.get('message', '')}")
                return obj
            if self.operator is not None and not self.operator.alive:
                raise AssertionError("the operator exited:\n" + self.operator.log_tail())
            time.sleep(0.25)
        st = obj.get("status") or {}
        raise AssertionError(
            f"RLJob {job.name} not done within {timeout:.0f} s: phase {st.get('phase')}, {st.get('message')}"
        )

    def delete_job(self, job: Job) -> None:
        """The RLJob deleted and its pod gone (its processes stopped); on a GPU, until its memory is back."""
        t0 = time.monotonic()
        self.kubectl_user("delete", "rljob", job.name, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
        deadline = time.monotonic() + self.deadline.left(120)
        while time.monotonic() < deadline:
            pods = self.api.get(
                f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector=f"rljob.io/job={job.name}"
            )
            if not pods["items"]:
                break
            time.sleep(0.25)
        if not self.stand_in:
            while time.monotonic() < deadline and _nvml_used() > self.gpu_used_at_start + (1 << 30):
                time.sleep(0.25)
            say(f"== RLJob {job.name} deleted, its pod gone, GPU memory used {_nvml_used() / 2**30:.2f} GiB "
                f"({time.monotonic() - t0:.1f} s)")  # fmt: skip

    def save_logs(self, job: Job, results: Path) -> None:
        """The pod's container logs and the operator's (their last 400 kB) into the results."""
        for log in (self.work / "pods" / NAMESPACE).glob(f"{job.name}-*/logs/*.log"):
            (results / f"operator_loop_{job.name}_{log.stem}.log").write_bytes(log.read_bytes()[-400_000:])
        if self.operator is not None and self.operator.log_path.exists():
            shutil.copy(self.operator.log_path, results / "operator_loop_operator.log")

    def log_tails(self, job: Job, lines: int = 40) -> str:
        out = []
        for log in sorted((self.work / "pods" / NAMESPACE).glob(f"{job.name}-*/logs/*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        if self.operator is not None:
            out.append("--- operator\n" + self.operator.log_tail(lines))
        return "\n".join(out)


# --- what `kubectl rljob` printed ------------------------------------------------------------------


def profile_rows(text: str) -> dict[int, dict[str, str]]:
    """`kubectl rljob profile`'s chart rows by iteration: GPU-BUSY, CACHE-HIT, TOK/S as printed."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ITER "))
    rows: dict[int, dict[str, str]] = {}
    for line in lines[header + 1 :]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        _rollout, busy, hit, _runwait, tps, _roofline, _per_sample = cells[-7:]
        rows[int(cells[0])] = {"gpu_busy": busy, "cache_hit": hit, "tokens_per_second": tps}
    return rows


def status_last(text: str) -> dict[str, str]:
    """`kubectl rljob status`'s last-iteration figures as printed."""
    hit = re.search(r"prefix-cache hit rate (\S+), generation (\S+) tok/s", text)
    busy = re.search(r"GPU busy (\S+) during rollout", text)
    assert hit and busy, text
    return {"cache_hit": hit.group(1), "tokens_per_second": hit.group(2), "gpu_busy": busy.group(1)}


def percent(printed: str) -> float:
    assert printed.endswith("%"), printed
    return float(printed[:-1]) / 100


# --- the comparison --------------------------------------------------------------------------------

# The agent's window contains the test's: it opens at the resume, before the trainer starts, and closes at
# the drain's last sample, after the trainer asked for the GPU. These two hand-offs are at most this long.
EDGE_SLACK_S = 1.0
# NVML's busy fraction (each driver sample: the share of its period in which any kernel ran) against
# SGLang's forward-pass seconds (CUDA events around each forward: sampling and other kernels outside,
# the idle gaps of an eager forward inside; a pass counted at the next batch).
GPU_BUSY_TOLERANCE = 0.15


@dataclass
class Row:
    iteration: int
    signal: str
    agent: float | None
    own: float
    tolerance: str
    ok: bool


def compare(job: Job, status: dict[str, Any], printed: dict[int, dict[str, str]]) -> list[Row]:
    """Per iteration: the agent's figures (status and what `kubectl rljob profile` printed) against SGLang's
    own /metrics over the rollout, read by the test at its edges."""
    reports = {r["iteration"]: r for r in status.get("iterationHistory") or []}
    windows = {
        s["iteration"]: (s.get("rollout") or {}).get("windowSeconds")
        for s in status.get("timeline") or []
        if s["phase"] == "Rollout"
    }
    rows: list[Row] = []
    for i in range(1, ITERATIONS + 1):
        r, shown = reports[i], printed[i]
        w_test, d = job.edges.window(i)
        w_agent = windows.get(i)
        assert w_agent is not None, f"no Rollout span of iteration {i} with a window: {windows}"
        for key, series in (
            ("promptTokens", PROMPT),
            ("cachedTokens", CACHED),
            ("generationTokens", GENERATED),
        ):
            own = d.get(series, 0.0)
            rows.append(Row(i, key, r.get(key), own, "exact", r.get(key) == round(own)))
        hit = d.get(CACHED, 0.0) / d[PROMPT]
        agent_hit = r.get("cacheHitRate")
        rows.append(
            Row(
                i,
                "cacheHitRate",
                agent_hit,
                hit,
                "1e-6",
                agent_hit is not None and abs(agent_hit - hit) <= 1e-6,
            )
        )
        rows.append(Row(i, "kubectl: CACHE-HIT", percent(shown["cache_hit"]), hit, "0.5 pt",
                        abs(percent(shown["cache_hit"]) - hit) <= 0.005 + 1e-6))  # fmt: skip
        rows.append(Row(i, "windowSeconds", w_agent, w_test, f"+0..{EDGE_SLACK_S:g} s",
                        w_test <= w_agent <= w_test + EDGE_SLACK_S))  # fmt: skip
        tps = d.get(GENERATED, 0.0) / w_test
        low = d.get(GENERATED, 0.0) / (w_test + EDGE_SLACK_S)
        agent_tps = r.get("generationTokensPerSecond")
        rows.append(Row(i, "generationTokensPerSecond", agent_tps, tps, f"x{low / tps:.2f}..1",
                        agent_tps is not None and low - 1e-3 <= agent_tps <= tps + 1e-3))  # fmt: skip
        shown_tps = float(shown["tokens_per_second"])
        rows.append(Row(i, "kubectl: TOK/S", shown_tps, tps, f"x{low / tps:.2f}..1 +-0.5",
                        low - 0.5 <= shown_tps <= tps + 0.5))  # fmt: skip
        busy = sum(d.get(s, 0.0) for s in FORWARD) / w_agent
        agent_busy = r.get("gpuBusyFraction")
        rows.append(Row(i, "gpuBusyFraction", agent_busy, busy, f"{GPU_BUSY_TOLERANCE:g}",
                        agent_busy is not None and abs(agent_busy - busy) <= GPU_BUSY_TOLERANCE))  # fmt: skip
        shown_busy = percent(shown["gpu_busy"])
        rows.append(Row(i, "kubectl: GPU-BUSY", shown_busy, busy, f"{GPU_BUSY_TOLERANCE:g} + 0.5 pt",
                        abs(shown_busy - busy) <= GPU_BUSY_TOLERANCE + 0.005))  # fmt: skip
    return rows


def table(rows: list[Row]) -> str:
    def num(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.4f}"

    lines = [f"{'ITER':4}  {'SIGNAL':26}  {'AGENT':>12}  {'SGLANG OWN':>12}  {'TOLERANCE':18}  OK"]
    lines += [
        f"{r.iteration:4}  {r.signal:26}  {num(r.agent):>12}  {num(r.own):>12}  {r.tolerance:18}  "
        f"{'ok' if r.ok else 'NO'}"
        for r in rows
    ]
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [vars(r) for r in rows]


def same_next_token(token: int, ref: dict[str, Any], tolerance: float) -> bool:
    """`token` is the trainer's greedy next token, or ties with it within `tolerance` nats in the trainer's
    forward (a near tie may fall either way in other kernels)."""
    if token == ref["next_token"]:
        return True
    return any(t == token and ref["next_logprob"] - lp <= tolerance for t, lp in ref.get("top", []))


def served_logprobs(url: str, reference: dict[str, Any]) -> dict[str, Any]:
    """SGLang's input-token logprobs and greedy next token for each reference prompt, against the
    trainer's transformers forward of the weights it published last."""
    out: dict[str, Any] = {}
    for name, ref in reference.items():
        body = {
            "input_ids": ref["input_ids"],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        req = urllib.request.Request(
            url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.loads(resp.read())
        meta = answer["meta_info"]
        served = [lp for lp, _tok, *_ in meta["input_token_logprobs"][1:]]
        ((next_lp, next_tok, *_),) = meta["output_token_logprobs"]
        pairs = [*zip(served, ref["input_logprobs"], strict=True), (next_lp, ref["next_logprob"])]
        out[name] = {
            "max_abs_diff": max(abs(a - b) for a, b in pairs),
            "next_token": next_tok,
            "ref_next_token": ref["next_token"],
            "weight_version": meta.get("weight_version"),
        }
    return out
