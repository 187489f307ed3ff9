"""Control overhead of the operator + agents per phase transition against the floor measured in the same
run, and status writes / API calls / operator CPU and RSS per iteration, for 1, 8, 64, 128, 256 and 512
pods, a projection to 1,024 and 4,096 pods checked against 256 and 512; then the operator's RSS with
100 RLJobs of 8 pods.

    .venv/bin/python -m pytest -q -s -m bench tests/bench/bench_control_overhead.py
    .venv/bin/python tests/bench/bench_control_overhead.py [--sizes 1,8,64,128,256,512]
        [--iterations 30,30,20,10,5,5] [--many-jobs 100 --many-pods 8] [--json F] [--profile DIR]
        [--gc-stats] [--operator-source DIR]

What runs: a real kube-apiserver + etcd (`LocalControlPlane`, cached binaries), the real operator process
(`rljob.controller.main`, its metrics endpoint bound to 127.0.0.1), the fake kubelet, and for every pod a
real agent and SGLang emulator, each a real HTTP server on the pod's loopback IP. Pods share processes
(`rljob.testing.shared_pods`): the agents and emulators of several pods on one event loop in one host
process, PODS_PER_HOST pods a host up to one host per two cores (HostShards, host_count), so that an agent
queues behind as few others as the machine allows; the trainers as threads driving the trainer SDK over
HTTP in this process. Zero-cost operations: emulator `--tokens-per-second 0`, no faults; trainer
`--train-seconds 0`, one prompt, one sample, 4 tokens, a 4 KiB checkpoint.

Measured, per pod count, over the iterations after a warm-up one (window: rollout of iteration 2 opens ->
Succeeded):
- per transition (Draining, Releasing, Training, Refitting, Resuming): from `status.timeline`, overhead =
  the phase's wall seconds - agentSeconds (the slowest pod's in-agent time), and the in-agent time;
  median and p95 (nearest rank: with 20 samples the second largest, with fewer than 20 the maximum).
  Training's wall time also holds the trainer's own step (lease granted -> publish answered, slowest pod,
  measured in the trainer driver): shown, and subtracted in the "Training - trainer step" row; and the
  slowest pod's lease as its agent timed it (the Training span's trainerSeconds), subtracted in the
  "Training - trainer's lease" row, the control plane's part of Training as agentSeconds leaves it of the
  others;
- the floor, per pod count, after the job succeeded and its operator stopped, on the same agents
  (control_floor.py): one command fanned out to every agent, every report back over channels already open,
  one status merge-patch, all over the operator's own client code (AgentWatch, Kube.patch_status); wall
  time minus the slowest agent's own time, as for the overhead; 10 rounds of the operator's cycle (drain,
  release, grant, refit, resume) with the job's trainers still running, each phase against the floor of
  its own command. A ratio to the floor is printed only when the floor's own inputs match the run's
  (floor_refused: the agents' in-agent time for each command, and the machine's load by everything but
  the measured process);
- per iteration: status writes (`rljob_status_writes_total`), operator API calls and their request bytes
  (`rljob_api_calls_total`, `rljob_api_request_bytes_total`; our calls only: kopf's own watches are not
  counted) and agent commands, from the operator's metrics endpoint scraped at both ends of the window (a
  write at either edge may fall on either side: +-1 per window); CPU seconds (utime + stime from
  /proc/<pid>/stat) of the operator, the agent/emulator hosts, kube-apiserver, etcd and this process (fake
  kubelet + trainer threads), and the machine's busy seconds (/proc/stat); operator CPU per pod per command
  phase (CPU per iteration / pods / 5); the operator's RSS at the end of the window; the RLJob's size;
- a projection of the per-iteration figures to 1,024 and 4,096 pods, fitted as a + b x pods on 64 and
  128 pods (FIT_SIZES) and checked against the larger sizes;
- many jobs: `--many-jobs` RLJobs of `--many-pods` pods, 2 iterations each, at once under one operator:
  every job must succeed within `--many-seconds`; the operator's VmHWM (the kernel's peak RSS) and CPU;
  past the window, what holds the unfinished jobs (their reasons, their pods' phases and scheduling).

The first line names the event loop the operator runs on (uvloop, a dependency of the package, as in its
image; where it is missing, asyncio's, which is not what a user runs) and the open-file limit the host
processes inherit (raised to the hard limit first, as the operator raises its own). `--profile DIR`
attaches py-spy to the operator for each measured window (DIR/operator-<pods>.txt,
collapsed stacks) and prints the top frames; `--gc-stats` times the operator's garbage collections
(gc.callbacks, tests/bench/gcstats/sitecustomize.py); `--operator-source DIR` runs the operator from
another source tree (DIR/operator), e.g. an earlier commit, for a before/after comparison.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import copy
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rljob.api import parse_job
from rljob.controller.children import token_secret_name
from rljob.controller.main import raise_open_file_limit
from rljob.testing.cluster import LocalControlPlane, ensure_binaries, free_port
from rljob.testing.harness import ROOT, OperatorProcess, rljob_path
from rljob.testing.kubeaccess import ApiError, KubeApi, Kubectl, create_namespace, delete_namespace
from rljob.testing.kubelet import ContainerContext, IpAllocator, Kubelet, Launch, Mapping
from rljob.testing.pods import SIM_ARGS_ENV
from rljob.testing.shared_pods import SharedPods, TrainerDriver

TRANSITIONS = ("Draining", "Releasing", "Training", "Refitting", "Resuming")
CPU_OF = ("operator", "agents+emulators", "kube-apiserver", "etcd", "kubelet+trainers")
DEFAULT_SIZES = (1, 8, 64, 128, 256, 512)
DEFAULT_ITERATIONS = (30, 30, 20, 10, 5, 5)
COMMAND_PHASES = 5  # drain, release, grant, refit, resume: one fan-out each per iteration
FLOOR_ROUNDS = 10  # command cycles of the floor: 10 samples of each command
BENCH_DIR = Path(__file__).resolve().parent
SIM_ARGS = "--tokens-per-second 0"
TRAINER_ARGS = [
    "--prompts", "1", "--samples-per-prompt", "1", "--max-new-tokens", "4", "--prefix-tokens", "8",
    "--train-seconds", "0", "--weights-bytes", "4096",
]  # fmt: skip


PODS_PER_HOST = 8  # pods whose agents and emulators share one host process (one event loop), at most...
CORES_PER_HOST = 2  # ...until there is a host per this many cores (at least MIN_HOSTS): then more pods a host
MIN_HOSTS = 8  # 800 pods' connections in 8 processes stay within one process's file descriptors


def host_count(pods: int, cores: int) -> int:
    """Host processes for `pods` pods: one per PODS_PER_HOST pods, at most one per CORES_PER_HOST cores,
    the rest of the machine left to the API server, the operator and the kubelet (on 16 cores: 8 hosts of
    8 pods at 64, 8 of 64 at 512, 8 of 100 for 800; docs/benchmarks.md has the run that set it)."""
    return max(1, min(-(-pods // PODS_PER_HOST), max(MIN_HOSTS, cores // CORES_PER_HOST)))


class HostShards:
    """Several shared host processes behind one kubelet mapping, a pod's components all in one of them (its
    uid's, in turn), so that an agent queues behind few others' agents and emulators on one event loop
    (host_count), and 800 pods' connections do not exhaust one process's file descriptors."""

    def __init__(
        self, work: Path, pods: int, liveness: float | None, rpc_timeout: float, hosts: int | None = None
    ) -> None:
        """`hosts`: this many host processes instead of host_count's."""
        self.shards = [
            SharedPods(
                work / f"shared-host-{i}.log", rpc_timeout=rpc_timeout, agent_liveness_seconds=liveness
            ).start()
            for i in range(hosts or host_count(pods, os.cpu_count() or 1))
        ]
        self._maps = [s.mapping() for s in self.shards]
        self._host_of: dict[str, int] = {}  # pod uid -> shard: round robin, as even as a hash is not
        self._lock = threading.Lock()  # the kubelet starts pods' containers from several threads

    def mapping(self) -> Mapping:
        def mapping(ctx: ContainerContext) -> Launch | Sequence[str] | None:
            uid = ctx.pod["metadata"]["uid"]
            with self._lock:
                host = self._host_of.setdefault(uid, len(self._host_of) % len(self._maps))
            return self._maps[host](ctx)

        return mapping

    def attach(self, kubelet: Kubelet) -> None:
        for s in self.shards:
            s.attach(kubelet)

    def stop(self) -> None:
        for s in self.shards:
            s.stop()

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.shards]

    @property
    def errors(self) -> list[str]:
        return [e for s in self.shards for e in s.errors]

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self.shards)

    def drivers(self) -> list[TrainerDriver]:
        return [d for s in self.shards for d in s.drivers()]


MANY_POLL_SECONDS = 5.0  # the many-jobs run looks at its RLJobs this often: its "after s" is this coarse


def pod_ip_base() -> str:
    """First pod IP of a random loopback /24: test runs of other processes on this machine (the fake
    kubelet's default pool is one per process) must not share pod IPs with the benchmark."""
    return f"127.{random.randint(64, 254)}.{random.randint(0, 255)}.2"


# -- measurements --------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, bytes."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)


def scrape(port: int) -> dict[str, float]:
    """Counter samples of the operator's metrics endpoint, keyed `name{label=value,...}`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (every core, /proc/stat's first line), since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is counted in user already


@dataclass
class Snapshot:
    at: float
    metrics: dict[str, float]
    cpu: dict[str, float]
    busy: float = 0.0  # machine_busy_seconds()


def p95(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class SizeResult:
    pods: int
    iterations: int  # measured (after the warm-up one)
    startup_seconds: float  # RLJob created -> rollout of iteration 1 open
    window_seconds: float
    overhead: dict[str, list[float]] = field(default_factory=dict)  # phase -> per iteration, seconds
    in_agent: dict[str, list[float]] = field(default_factory=dict)
    trainer_step: list[float] = field(default_factory=list)  # slowest pod, per iteration
    # Training's span trainerSeconds: the slowest pod's lease, its agent's grant to the publish
    trainer_lease: list[float] = field(default_factory=list)
    iteration_overhead: list[float] = field(default_factory=list)  # status.lastIteration, seconds
    per_iteration: dict[str, float] = field(default_factory=dict)  # counters and CPU seconds / iteration
    api_verbs: dict[str, float] = field(default_factory=dict)  # per iteration
    status_fields: dict[str, float] = field(default_factory=dict)  # per iteration: what the writes changed
    commands: dict[str, float] = field(default_factory=dict)  # "action outcome" -> per iteration
    rss: int = 0  # operator VmRSS at the end of the window, bytes
    rss_peak: int = 0  # VmHWM
    floor: list[dict[str, Any]] = field(default_factory=list)  # control_floor.py samples
    floor_cpu: float = 0.0  # CPU s of the floor process over its transitions
    floor_seconds: float = 0.0  # their wall time
    floor_busy: float = 0.0  # the machine's busy CPU s over them
    busy: float = 0.0  # the machine's busy CPU s over the measured window
    object_bytes: int = 0  # the RLJob's JSON at the end (what every watcher of it receives per change)
    cores: int = 0  # of the machine it ran on
    gc: dict[str, Any] = field(default_factory=dict)  # --gc-stats: the window's collections
    profile: str | None = None  # --profile: collapsed stacks of the window

    def floor_samples(self, action: str | None = None) -> list[dict[str, Any]]:
        return [s for s in self.floor if action in (None, s["action"])]

    def floor_overhead(self, action: str | None = None) -> list[float]:
        return [s["wall"] - s["in_agent"] for s in self.floor_samples(action)]

    def load(self) -> float:
        """Cores busy with anything but the operator over the window: the stand-ins, the API server, etcd."""
        operator = self.per_iteration.get("CPU operator", 0.0) * self.iterations
        return (self.busy - operator) / self.window_seconds

    def floor_load(self) -> float:
        """Cores busy with anything but the floor's own process over its transitions."""
        return (self.floor_busy - self.floor_cpu) / self.floor_seconds if self.floor_seconds else float("nan")


# The floor's own inputs must match the run's within these, or no ratio is printed (floor_refused).
IN_AGENT_MARGIN = 1.5  # the floor's in-agent p50 within this factor of the run's, either way ...
IN_AGENT_SLACK = 0.010  # ... or within this many seconds: a scheduler slice on a loaded machine
LOAD_MARGIN = 0.25  # the machine's other load within this share of its cores


# The floor's command for each phase of the run (control_floor.py runs the operator's cycle).
FLOOR_OF = {"Draining": "drain", "Releasing": "release", "Training": "grant", "Refitting": "refit",
            "Resuming": "resume"}  # fmt: skip


def floor_refused(r: SizeResult, cores: int) -> str | None:
    """Why `r`'s floor is not comparable with its run (None: it is). The floor ran on the same agents after
    the run; it bounds the operator from below only if its agents were as fast (their own time for each
    command) and the machine as loaded (by everything but the measured process) as during the run."""
    if not r.floor:
        return "no floor"
    for phase, action in FLOOR_OF.items():
        if not r.floor_samples(action):
            continue  # a run saved before the floor ran every command
        floor = statistics.median(s["in_agent"] for s in r.floor_samples(action))
        run = statistics.median(r.in_agent[phase])
        within = 1 / IN_AGENT_MARGIN <= floor / max(run, 1e-9) <= IN_AGENT_MARGIN
        if abs(floor - run) > IN_AGENT_SLACK and not within:
            return f"{action} in-agent {_ms(floor)} ms vs {_ms(run)} in the run"
    if abs(r.floor_load() - r.load()) > LOAD_MARGIN * cores:
        return f"load {r.floor_load():.2f} cores vs {r.load():.2f} in the run"
    return None


@dataclass
class ManyResult:
    jobs: int
    pods: int
    seconds: float  # creation of the first RLJob -> every job Succeeded
    rss_peak: int  # VmHWM once every job succeeded (or the window ended): the kernel's peak
    rss_end: int  # VmRSS once every job succeeded
    cpu: float  # operator CPU seconds over the whole run
    restarts: int = 0  # gang restarts over all jobs (an overloaded shared host times out GPU probes)
    succeeded: int | None = None  # jobs Succeeded when the run ended (fewer than `jobs`: it timed out)


def delta(before: Snapshot, after: Snapshot, prefix: str) -> dict[str, float]:
    return {
        k: after.metrics[k] - before.metrics.get(k, 0.0)
        for k in after.metrics
        if k.startswith(prefix + "{") and after.metrics[k] - before.metrics.get(k, 0.0)
    }


def list_after_write(api: KubeApi, samples: int = 20) -> dict[str, list[float]]:
    """The operator lists its pods right after writing status and events. A consistent list (no
    resourceVersion) is served from the watch cache once the cache has caught up with etcd's latest
    revision; this times it after a write to another object, against resourceVersion=0 (any cached)."""
    ns, name = "default", f"bench-probe-{uuid.uuid4().hex[:6]}"
    path = f"/api/v1/namespaces/{ns}/configmaps"
    api.post(path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"n": "0"}})
    out: dict[str, list[float]] = {"consistent (no resourceVersion)": [], "resourceVersion=0": []}
    try:
        for kind, params in zip(out, ({}, {"resourceVersion": "0"}), strict=True):
            for i in range(samples):
                api.merge_patch(f"{path}/{name}", {"data": {"n": f"{kind}-{i}"}})
                began = time.perf_counter()
                api.get(f"/api/v1/namespaces/{ns}/pods", labelSelector="rljob.io/job=none", **params)
                out[kind].append(time.perf_counter() - began)
    finally:
        api.delete(f"{path}/{name}")
    return out


# -- one pod count -------------------------------------------------------------------------------
def manifest(name: str, replicas: int, iterations: int) -> dict[str, Any]:
    m = copy.deepcopy(yaml.safe_load((ROOT / "examples/rljob.yaml").read_text()))
    m["metadata"] = {"name": name}
    spec = m["spec"]
    spec.update(replicas=replicas, iterations=iterations, podsAfterFinished="Keep")
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = spec["template"]["spec"]["containers"]
    sglang["env"] = [*sglang.get("env", []), {"name": SIM_ARGS_ENV, "value": SIM_ARGS}]
    trainer["args"] = list(TRAINER_ARGS)
    return dict(m)


@dataclass(frozen=True)
class Options:
    profile_dir: Path | None = None
    gc_stats: bool = False
    operator_source: Path | None = None  # a source tree whose operator/ runs instead of this one's
    hosts: int | None = None  # host processes for every size (None: host_count's)


class Bench:
    def __init__(self, plane: LocalControlPlane, workdir: Path, options: Options = Options()) -> None:
        self.plane = plane
        self.kubeconfig = plane.kubeconfig
        self.api = KubeApi.from_kubeconfig(self.kubeconfig)
        self.workdir = workdir
        self.options = options
        Kubectl(self.kubeconfig)("apply", "-f", str(ROOT / "crds"))
        Kubectl(self.kubeconfig)(
            "wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=30s"
        )
        deadline = time.monotonic() + 30
        while True:  # Established comes a moment before the storage serves (429 "(re)initializing")
            try:
                self.api.get(rljob_path("default"))
                break
            except ApiError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # The floor's status patches go to an RLJob in a namespace no operator watches.
        self.floor_ns = f"bench-floor-{uuid.uuid4().hex[:6]}"
        create_namespace(self.api, self.floor_ns)
        self.api.post(rljob_path(self.floor_ns), manifest("floor", 1, 1))

    def _operator(self, ns: list[str], work: Path, port: int) -> OperatorProcess:
        """The operator process, from --operator-source and with --gc-stats when asked."""
        extra = {}
        paths = []
        if self.options.gc_stats:
            paths.append(str(BENCH_DIR / "gcstats"))
            extra["RLJOB_GC_STATS"] = str(work / "gc-stats.json")
        if self.options.operator_source is not None:
            paths.append(str(self.options.operator_source / "operator"))
        if paths:
            extra["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            return OperatorProcess(
                self.kubeconfig, ns, work / "operator.log",
                ["--metrics-port", str(port), "--metrics-address", "127.0.0.1"],
            ).start()  # fmt: skip
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, pods: int, measured: int, timeout: float | None = None) -> SizeResult:
        timeout = timeout or max(600.0, 3.0 * pods)
        ns = f"bench-{pods}-{uuid.uuid4().hex[:6]}"
        work = self.workdir / f"pods-{pods}"
        create_namespace(self.api, ns)
        port = free_port()
        # A host starts its components one after the other: with many pods the last waits minutes.
        # Past 64 pods the agents' 1 s SGLang liveness check (one per agent and per second) is a fifth of
        # a core per 64 agents: every 5 s instead, as the agents of a real cluster have a core each.
        shared = HostShards(
            work,
            pods,
            liveness=None if pods <= 64 else 5.0,
            rpc_timeout=max(30.0, 1.0 * pods),
            hosts=self.options.hosts,
        )
        kubelet = Kubelet(
            self.kubeconfig, [ns], mapping=shared.mapping(), scratch_root=work / "pods",
            # the agent's readinessProbe period; a calm kubelet for 64 pods, calmer for more (at 512 the
            # local API server times out pod status writes otherwise); no per-pod hosts files: the
            # trainers are threads given their URLs, and rewriting N files per pod event is O(N^2)
            probe_period=2.0 if pods <= 64 else 5.0, tick=0.2 if pods <= 64 else 1.0, pod_hosts=False,
            ips=IpAllocator(pod_ip_base()), nodes=max(2, -(-pods // 8)),  # 8 GPUs a node, 1 a pod
        )  # fmt: skip
        shared.attach(kubelet)
        kubelet.start()
        operator = self._operator([ns], work, port)
        with self._torn_down(f"{pods} pods", ns, operator, kubelet, shared):
            result = self._measure(ns, pods, measured, port, shared, operator, timeout, work)
            result.rss, result.rss_peak = rss_bytes(_pid(operator))
            operator.stop()  # the floor runs on the same agents, with the machine to itself
            self._floor(ns, "bench", result, work)
            return result

    @contextlib.contextmanager
    def _torn_down(
        self,
        label: str,
        ns: str,
        operator: OperatorProcess,
        kubelet: Kubelet,
        shared: HostShards,
    ) -> Iterator[None]:
        """Runs the block; shows the operator's log tail if it fails; stops everything and deletes the
        namespace whatever happens."""
        try:
            yield
        except BaseException:
            print(f"\n[{label}] operator log tail:\n{operator.log_tail(40)}", file=sys.stderr)
            raise
        finally:
            operator.stop()
            kubelet.stop()
            shared.stop()
            delete_namespace(self.api, ns)

    def _pids(self, shared: HostShards, operator: OperatorProcess) -> dict[str, list[int]]:
        state = self.plane.state
        assert state is not None and operator.proc is not None
        return dict(
            zip(
                CPU_OF,
                ([operator.proc.pid], shared.pids, [state.apiserver_pid], [state.etcd_pid], [os.getpid()]),
                strict=True,
            )
        )

    def _snapshot(self, port: int, pids: dict[str, list[int]]) -> Snapshot:
        cpu = {k: sum(map(cpu_seconds, group)) for k, group in pids.items()}
        return Snapshot(time.monotonic(), scrape(port), cpu, machine_busy_seconds())

    def _floor(self, ns: str, name: str, result: SizeResult, work: Path) -> None:
        """control_floor.py on the job's agents, once the job has succeeded and its operator stopped."""
        job = self.api.get(rljob_path(ns, name))
        port = parse_job(job).agent.port
        pods = self.api.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=f"rljob.io/job={name}")["items"]
        secret = self.api.get(f"/api/v1/namespaces/{ns}/secrets/{token_secret_name(name)}")
        token = base64.b64decode(next(iter(secret["data"].values()))).decode()
        request = {
            "agents": [[p["metadata"]["name"], p["status"]["podIP"], port] for p in pods],
            "token": token,
            "job": job,
            "rounds": FLOOR_ROUNDS,
            "kubeconfig": str(self.kubeconfig),
            "namespace": self.floor_ns,
            "name": "floor",
            "status": job["status"],
        }
        # The floor's patches go to an object as large as the job's: its final status, copied.
        self.api.merge_patch(rljob_path(self.floor_ns, "floor") + "/status", {"status": job["status"]})
        req, out = work / "floor-request.json", work / "floor-result.json"
        req.write_text(json.dumps(request))
        floor = [sys.executable, str(BENCH_DIR / "control_floor.py"), str(req), str(out)]
        try:
            subprocess.run(floor, check=True, timeout=1500)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            # The sizes measured so far and the ones after are kept: this size's floor prints as nan.
            print(f"[{result.pods} pods: the floor failed: {err}]", flush=True)
            return
        got = json.loads(out.read_text())
        result.floor, result.floor_cpu = got["samples"], got["cpu"]
        result.floor_seconds, result.floor_busy = got["seconds"], got["busy"]

    def run_many(self, jobs: int, pods: int, timeout: float = 1200) -> ManyResult:
        """`jobs` RLJobs of `pods` pods, 2 iterations each, at once under one operator: its RSS."""
        ns = f"bench-many-{uuid.uuid4().hex[:6]}"
        work = self.workdir / f"many-{jobs}x{pods}"
        create_namespace(self.api, ns)
        port = free_port()
        shared = HostShards(work, jobs * pods, liveness=5.0, rpc_timeout=max(30.0, 1.0 * jobs * pods))
        kubelet = Kubelet(
            self.kubeconfig, [ns], mapping=shared.mapping(), scratch_root=work / "pods",
            probe_period=5.0, tick=1.0, ips=IpAllocator(pod_ip_base()), nodes=max(2, -(-jobs * pods // 8)),
            pod_hosts=False,
        )  # fmt: skip
        shared.attach(kubelet)
        kubelet.start()
        operator = self._operator([ns], work, port)
        with self._torn_down("many jobs", ns, operator, kubelet, shared):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    scrape(port)
                    break
                except OSError:
                    if time.monotonic() > deadline or not operator.alive:
                        raise RuntimeError(f"operator never came up:\n{operator.log_tail()}") from None
                    time.sleep(0.2)
            cpu0 = cpu_seconds(_pid(operator))
            began = time.monotonic()
            for j in range(jobs):
                job = manifest(f"job-{j:03d}", pods, 2)
                # 800 pods' containers start one after the other on a small test host: more than the 900 s
                # a gang may take to start by default, which the run is not about.
                job["spec"]["phaseTimeoutSeconds"] = {"initializing": int(timeout)}
                self.api.post(rljob_path(ns), job)
            items: list[dict[str, Any]] = []
            phases: collections.Counter[str | None] = collections.Counter()
            while True:
                try:  # from the watch cache: a consistent list of 100 RLJobs a second loads the server
                    items = self.api.get(rljob_path(ns), resourceVersion="0")["items"]
                    phases = collections.Counter((o.get("status") or {}).get("phase") for o in items)
                except (ApiError, requests.RequestException) as err:  # an API server this loaded times out
                    print(f"[many jobs: listing the RLJobs: {err!r}; again]", flush=True)
                if phases.get("Succeeded", 0) == jobs:
                    break
                # A gang restart is the operator doing its job (the RSS figure stands); a failure is not.
                if phases.get("Failed"):
                    raise RuntimeError(f"{jobs} jobs x {pods} pods: {dict(phases)}")
                if time.monotonic() > deadline:  # the RSS so far stands; the table says how many finished
                    print(f"[many jobs: timed out after {timeout:.0f}s: {dict(phases)}]", flush=True)
                    print(f"[many jobs: where the unfinished ones are: {self._stuck(ns, items)}]", flush=True)
                    break
                time.sleep(MANY_POLL_SECONDS)
            end, peak = rss_bytes(_pid(operator))  # VmHWM: the kernel's peak, not a sample
            restarts = sum((o.get("status") or {}).get("restarts", 0) for o in items)
            print(  # before the teardown of hundreds of pods, which takes minutes
                f"[many jobs: operator RSS {end / 2**20:.1f} MiB, VmHWM {peak / 2**20:.1f} MiB; "
                f"{dict(phases)}; {restarts} gang restarts]", flush=True,
            )  # fmt: skip
            return ManyResult(
                jobs, pods, time.monotonic() - began, peak, end, cpu_seconds(_pid(operator)) - cpu0,
                restarts, phases.get("Succeeded", 0),
            )  # fmt: skip

    def _stuck(self, ns: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        """What holds the unfinished jobs: their reasons, and their pods' phases and scheduling."""
        try:
            pods = self.api.get(f"/api/v1/namespaces/{ns}/pods", resourceVersion="0")["items"]
        except (ApiError, requests.RequestException) as err:
            return {"pods": repr(err)}
        unfinished = [o for o in jobs if (o.get("status") or {}).get("phase") != "Succeeded"]
        states: collections.Counter[str] = collections.Counter()
        for pod in pods:
            st = pod.get("status") or {}
            scheduled = next((c for c in st.get("conditions", []) if c.get("type") == "PodScheduled"), {})
            waiting = [
                c["state"]["waiting"].get("reason", "?")
                for c in st.get("containerStatuses", []) + st.get("initContainerStatuses", [])
                if "waiting" in (c.get("state") or {})
            ]
            state = f"{st.get('phase')} scheduled={scheduled.get('status')} waiting={sorted(set(waiting))}"
            states[state] += 1
        reasons = collections.Counter((o.get("status") or {}).get("reason") for o in unfinished)
        first = (unfinished[0].get("status") or {}).get("message") if unfinished else None
        return {"reasons": dict(reasons), "first message": first, "pods": dict(states)}

    def _gc_stats(self, work: Path) -> dict[str, Any]:
        path = work / "gc-stats.json"
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return {}

    def _measure(
        self, ns: str, pods: int, measured: int, port: int, shared: HostShards, operator: OperatorProcess,
        timeout: float, work: Path,
    ) -> SizeResult:  # fmt: skip
        name = "bench"
        total = measured + 1  # iteration 1 warms up (pods start, first refit)
        pids = self._pids(shared, operator)
        deadline = time.monotonic() + timeout
        while True:  # the operator's metrics endpoint is up once kopf runs
            try:
                scrape(port)
                break
            except OSError:
                if time.monotonic() > deadline or not operator.alive:
                    raise RuntimeError(f"operator metrics never came up:\n{operator.log_tail()}") from None
                time.sleep(0.1)
        listing = self.api.get(rljob_path(ns))
        created = time.monotonic()
        self.api.post(rljob_path(ns), manifest(name, pods, total))
        spans: dict[tuple[int, str], dict[str, Any]] = {}
        reports: dict[int, float] = {}
        start: Snapshot | None = None
        gc_start: dict[str, Any] = {}
        gc_end: dict[str, Any] = {}
        spy: tuple[subprocess.Popen[bytes], Path] | None = None
        host_spy: tuple[subprocess.Popen[bytes], Path] | None = None
        profile: str | None = None
        first_rollout: float | None = None
        rv = listing["metadata"]["resourceVersion"]
        final: dict[str, Any] = {}
        while not final:
            if time.monotonic() > deadline:
                status = self.api.get(rljob_path(ns, name)).get("status")
                raise TimeoutError(f"{pods} pods: not Succeeded after {timeout}s: {status}")
            try:
                stream = self.api.watch(rljob_path(ns), rv, read_timeout=30)
            except (requests.ConnectionError, requests.Timeout):  # an API server this loaded times out
                continue
            try:
                for event in stream:
                    obj = event.get("object") or {}
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if event.get("type") not in ("ADDED", "MODIFIED"):
                        continue
                    status = obj.get("status") or {}
                    phase, iteration = status.get("phase"), status.get("iteration", 0)
                    if phase == "Rollout" and iteration == 1 and first_rollout is None:
                        first_rollout = time.monotonic()
                    if phase == "Rollout" and iteration == 2 and start is None:
                        start = self._snapshot(port, pids)
                        gc_start = self._gc_stats(work)
                        spy = self._spy(operator, pods)
                        host_spy = self._spy_pid(shared.pids[0], f"shared-host-{pods}.txt")
                    for span in status.get("timeline") or []:
                        if span.get("seconds") is not None:
                            spans[(span["iteration"], span["phase"])] = span
                    last = status.get("lastIteration")
                    if last:
                        reports[last["iteration"]] = last.get("controlOverheadSeconds", 0.0)
                    if phase == "Succeeded":
                        end = self._snapshot(port, pids)
                        gc_end = self._gc_stats(work)
                        profile = self._unspy(spy)
                        self._unspy(host_spy)
                        final = obj
                        break
                    if phase in ("Failed", "Recovering"):
                        raise RuntimeError(
                            f"{pods} pods: {phase}: {status.get('reason')}: {status.get('message')}"
                        )
            except (requests.ConnectionError, requests.Timeout):
                continue  # an idle read timed out: resume from rv
            finally:
                stream.close()
        assert start is not None and first_rollout is not None
        status = final["status"]
        assert status["weightVersion"] == str(total) and status["restarts"] == 0, status
        assert not shared.errors, shared.errors
        assert shared.alive, "the shared agent/emulator host died"
        its = range(2, total + 1)
        steps = defaultdict(list)
        for driver in shared.drivers():
            for version, seconds in driver.steps.items():
                steps[int(version)].append(seconds)  # version k is published in iteration k
        result = SizeResult(pods, measured, first_rollout - created, end.at - start.at)
        result.busy = end.busy - start.busy
        result.object_bytes = len(json.dumps(final, separators=(",", ":")))
        result.cores = os.cpu_count() or 1
        for phase in TRANSITIONS:
            got = [spans[(i, phase)] for i in its]
            result.overhead[phase] = [s["seconds"] - (s.get("agentSeconds") or 0.0) for s in got]
            result.in_agent[phase] = [s.get("agentSeconds") or 0.0 for s in got]
        result.trainer_step = [max(steps[i]) for i in its]
        result.trainer_lease = [spans[(i, "Training")].get("trainerSeconds") or 0.0 for i in its]
        result.iteration_overhead = [reports[i] for i in its if i in reports]
        n = float(measured)
        counters = {
            "status writes": sum(delta(start, end, "rljob_status_writes_total").values()),
            "API calls": sum(delta(start, end, "rljob_api_calls_total").values()),
            "agent commands": sum(delta(start, end, "rljob_agent_commands_total").values()),
            "agent reports": sum(delta(start, end, "rljob_agent_reports_total").values()),
            "API request KiB": sum(delta(start, end, "rljob_api_request_bytes_total").values()) / 1024,
        }
        decisions = {_labels(k): v for k, v in delta(start, end, "rljob_decisions_total").items()}
        counters |= {f"decisions {k}": v for k, v in sorted(decisions.items())}
        pod_events = {_labels(k): v for k, v in delta(start, end, "rljob_pod_events_total").items()}
        counters |= {f"pod events {k}": pod_events.get(k, 0.0) for k in ("lifecycle", "readiness", "none")}
        result.per_iteration = {k: v / n for k, v in counters.items()}
        result.per_iteration |= {f"CPU {k}": (end.cpu[k] - start.cpu[k]) / n for k in CPU_OF}
        result.commands = {
            _labels(k): v / n for k, v in delta(start, end, "rljob_agent_commands_total").items()
        }
        result.api_verbs = {_labels(k): v / n for k, v in delta(start, end, "rljob_api_calls_total").items()}
        result.status_fields = {
            _labels(k): v / n for k, v in delta(start, end, "rljob_status_fields_written_total").items()
        }
        result.per_iteration["CPU operator / pod / phase ms"] = (
            result.per_iteration["CPU operator"] / pods / COMMAND_PHASES * 1000
        )
        result.gc = {
            gen: {k: (v - gc_start.get(gen, {}).get(k, 0)) / n for k, v in stats.items() if k != "max"}
            | {"max": stats.get("max", 0.0)}
            for gen, stats in gc_end.items()
        }
        result.profile = profile
        return result

    def _spy(self, operator: OperatorProcess, pods: int) -> tuple[subprocess.Popen[bytes], Path] | None:
        return self._spy_pid(_pid(operator), f"operator-{pods}.txt")

    def _spy_pid(self, pid: int, name: str) -> tuple[subprocess.Popen[bytes], Path] | None:
        """py-spy one process (the operator, or the shared agent/emulator host) into the profile dir."""
        if self.options.profile_dir is None:
            return None
        self.options.profile_dir.mkdir(parents=True, exist_ok=True)
        out = self.options.profile_dir / name
        beside = Path(sys.executable).parent / "py-spy"  # a virtualenv's; else the PATH's
        spy = beside if beside.exists() else Path(shutil.which("py-spy") or beside)
        # --gil: only the thread holding the GIL, i.e. where the operator's Python CPU goes.
        cmd = [str(spy), "record", "-p", str(pid), "-r", "200", "-f", "raw", "-o", str(out)]
        cmd += ["--gil", "--nonblocking"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return proc, out

    def _unspy(self, spy: tuple[subprocess.Popen[bytes], Path] | None) -> str | None:
        if spy is None:
            return None
        proc, out = spy
        proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        return str(out) if out.exists() else None


def _pid(operator: OperatorProcess) -> int:
    assert operator.proc is not None, "not started"
    return operator.proc.pid


def _labels(key: str) -> str:
    """`name{a=x,b=y}` -> `x y`."""
    return " ".join(kv.split("=", 1)[1] for kv in key.split("{", 1)[1].rstrip("}").split(","))


# -- tables --------------------------------------------------------------------------------------
def _ms(v: float) -> str:
    return f"{v * 1000:.1f}"


def _floor_p50(r: SizeResult, phase: str) -> float:
    """The floor of the phase's own command (a run saved before the floor ran every command: of all)."""
    got = r.floor_overhead(FLOOR_OF[phase]) or r.floor_overhead()
    return statistics.median(got) if got else float("nan")


def breakdown_table(column: str, pods: list[int], counts: list[dict[str, float]]) -> list[str]:
    """One row per key of `counts` (one dict per pod count), one column per pod count."""
    rows = [f"| {column} | " + " | ".join(f"{n} pods" for n in pods) + " |", "|---|" + "---:|" * len(pods)]
    for key in sorted({k for c in counts for k in c}):
        rows.append(f"| {key} | " + " | ".join(f"{c.get(key, 0.0):.1f}" for c in counts) + " |")
    return rows


def _ratio(value: float, r: SizeResult, cores: int, phase: str) -> str:
    refused = floor_refused(r, cores)
    return f"no ratio: {refused}" if refused else f"{value / _floor_p50(r, phase):.2f}x"


# What an operator team sizing a cluster asks for, per iteration of one job: (label, figure of a result,
# bounded: the figure cannot grow with the gang, as the status lists at most MAX_PODS_IN_STATUS pods).
PROJECTED: tuple[tuple[str, Any, bool], ...] = (
    ("operator CPU per command phase, s", lambda r: r.per_iteration["CPU operator"] / COMMAND_PHASES, False),
    ("API calls", lambda r: r.per_iteration["API calls"], False),
    ("API request KiB", lambda r: r.per_iteration.get("API request KiB", float("nan")), True),
    ("status writes", lambda r: r.per_iteration["status writes"], False),
    ("agent reports", lambda r: r.per_iteration["agent reports"], False),
    ("RLJob object KiB", lambda r: r.object_bytes / 1024, True),
    ("operator peak RSS MiB (VmHWM)", lambda r: r.rss_peak / 2**20, False),
)
# The line is fitted where the RLJob's status lists as many pods as it ever will (MAX_PODS_IN_STATUS, 64):
# from there on a figure grows with the gang only through what each pod costs. Larger sizes check it.
FIT_SIZES = (64, 128)
PROJECT_TO = (1024, 4096)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x; one point: through the origin."""
    if len(points) == 1:
        ((x, y),) = points
        return 0.0, y / x
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def projection_table(results: list[SizeResult], many: ManyResult | None) -> list[str]:
    """Each figure as a + b * pods, fitted on FIT_SIZES, its prediction beside the measured value at every
    larger size (the check), and projected to PROJECT_TO."""
    fitted = [r for r in results if r.pods in FIT_SIZES]
    checks = [r for r in results if r.pods > max(FIT_SIZES)]
    if len(fitted) < 2:
        return []
    head = ["figure per iteration", "a + b x pods", *(f"{r.pods}: measured / predicted" for r in checks),
            *(f"{n} pods" for n in PROJECT_TO)]  # fmt: skip
    out = [
        "",
        f"Projection: each figure fitted as a + b x pods on {' and '.join(str(r.pods) for r in fitted)} pods "
        "(past 64 the status lists no more pods: MAX_PODS_IN_STATUS), checked against the larger sizes "
        "measured in this run, "
        f"projected to {' and '.join(map(str, PROJECT_TO))} pods (one job)",
        "",
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * (len(head) - 2),
    ]
    for label, figure, bounded in PROJECTED:
        points = [(r.pods, figure(r)) for r in fitted]
        a, b = (statistics.fmean(y for _, y in points), 0.0) if bounded else fit_line(points)
        cells = [label, f"{a:.3g} (bounded)" if bounded else f"{a:.3g} + {b:.3g} x"]
        for r in checks:
            got, want = figure(r), a + b * r.pods
            cells.append(f"{got:.3g} / {want:.3g} ({got / want:.2f}x)" if want else f"{got:.3g} / 0")
        cells += [f"{a + b * n:.3g}" for n in PROJECT_TO]
        out.append("| " + " | ".join(cells) + " |")
    if many is not None and many.succeeded == many.jobs:
        per_job = many.cpu / many.jobs
        out += [
            "",
            f"Many jobs: {many.jobs} x {many.pods} pods measured; per job (its 2 iterations and start-up) "
            f"{per_job:.2f} operator CPU s; VmHWM {many.rss_peak / 2**20:.1f} MiB. At the same per-job cost, "
            + "; ".join(
                f"{n // many.pods} jobs of {many.pods} pods ({n} pods): {per_job * n / many.pods:.0f} CPU s"
                for n in PROJECT_TO
            )
            + " (RSS is not projected: it is not linear in jobs, see the table above)",
        ]
    return out


def tables(
    results: list[SizeResult], probe: dict[str, list[float]], many: ManyResult | None = None, cores: int = 0
) -> str:
    cores = cores or (results[0].cores if results else 0) or os.cpu_count() or 1
    out = [
        "Control overhead per phase transition (wall - slowest pod's in-agent time), ms; median and p95 "
        "(nearest rank) over the measured iterations; the floor (p50 of the phase's own command: drain, "
        "release, grant, refit, resume; on the same agents in the same run, over the operator's own "
        "transport and patch path) and the ratio of the overhead's p50 to it, printed only when the floor's "
        f"inputs match the run's (in-agent p50 of each command within {IN_AGENT_MARGIN}x or "
        f"{IN_AGENT_SLACK * 1000:.0f} ms, the machine's other load "
        f"within {LOAD_MARGIN:.0%} of its {cores} cores)",
        "",
        "| phase | pods | iterations | overhead p50 | overhead p95 | floor p50 | p50 / floor "
        "| in-agent p50 | in-agent p95 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in TRANSITIONS:
        for r in results:
            o, a = r.overhead[phase], r.in_agent[phase]
            label = "Training (grant)" if phase == "Training" else phase
            out.append(
                f"| {label} | {r.pods} | {r.iterations} | {_ms(statistics.median(o))} | {_ms(p95(o))} | "
                f"{_ms(_floor_p50(r, phase))} | {_ratio(statistics.median(o), r, cores, phase)} | "
                f"{_ms(statistics.median(a))} | {_ms(p95(a))} |"
            )
    for r in results:
        rest = [o - t for o, t in zip(r.overhead["Training"], r.trainer_step, strict=True)]
        out.append(
            f"| Training - trainer step | {r.pods} | {r.iterations} | {_ms(statistics.median(rest))} | "
            f"{_ms(p95(rest))} | | | trainer step p50 {_ms(statistics.median(r.trainer_step))} | "
            f"p95 {_ms(p95(r.trainer_step))} |"
        )
    for r in results:
        rest = [o - t for o, t in zip(r.overhead["Training"], r.trainer_lease, strict=True)]
        out.append(
            f"| Training - trainer's lease (agent-timed) | {r.pods} | {r.iterations} | "
            f"{_ms(statistics.median(rest))} | {_ms(p95(rest))} | {_ms(_floor_p50(r, 'Training'))} | "
            f"{_ratio(statistics.median(rest), r, cores, 'Training')} | "
            f"lease p50 {_ms(statistics.median(r.trainer_lease))} | p95 {_ms(p95(r.trainer_lease))} |"
        )
    for r in results:
        cmd = r.iteration_overhead
        out.append(
            f"| sum of the 4 command phases (lastIteration.controlOverheadSeconds) | {r.pods} | "
            f"{len(cmd)} | {_ms(statistics.median(cmd))} | {_ms(p95(cmd))} | | | | |"
        )
    out += [
        "",
        "The floor (control_floor.py: one command to every agent over the operator's AgentWatch channels, "
        "the reports back, one status merge-patch with Kube.patch_status; wall - slowest agent's own time), "
        "ms, beside its inputs and the run's: in-agent p50, and the machine's other load (busy cores "
        "minus the measured process's, /proc/stat)",
        "",
        "| pods | command | samples | floor p50 | floor p95 | of which the status patch p50 | in-agent p50 "
        "| run's in-agent p50 | load cores | run's load cores | floor process CPU / pod / transition ms "
        "| verdict |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for phase, action in FLOOR_OF.items():
            got = r.floor_samples(action)
            if not got:
                continue
            f = r.floor_overhead(action)
            cpu = r.floor_cpu / len(r.floor) / r.pods * 1000
            out.append(
                f"| {r.pods} | {action} | {len(got)} | {_ms(statistics.median(f))} | {_ms(p95(f))} | "
                f"{_ms(statistics.median(x['patch'] for x in got))} | "
                f"{_ms(statistics.median(x['in_agent'] for x in got))} | "
                f"{_ms(statistics.median(r.in_agent[phase]))} | {r.floor_load():.2f} | {r.load():.2f} | "
                f"{cpu:.3f} | {floor_refused(r, cores) or 'comparable'} |"
            )
    out += [
        "",
        "Operator: CPU per pod per command phase (CPU per iteration / pods / 5), RSS at the window's end",
        "",
        "| pods | CPU operator / iteration s | CPU / pod / phase ms | RSS MiB | peak RSS MiB |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        out.append(
            f"| {r.pods} | {r.per_iteration['CPU operator']:.3f} | "
            f"{r.per_iteration['CPU operator / pod / phase ms']:.3f} | {r.rss / 2**20:.1f} | "
            f"{r.rss_peak / 2**20:.1f} |"
        )
    if many is not None:
        out += [
            "",
            f"Operator RSS with {many.jobs} RLJobs x {many.pods} pods (2 iterations each, all at once)",
            "",
            "| jobs | pods each | Succeeded | after s | VmHWM MiB | RSS at the end MiB | CPU s "
            "| gang restarts |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {many.jobs} | {many.pods} | {many.jobs if many.succeeded is None else many.succeeded} | "
            f"{many.seconds:.0f} | {many.rss_peak / 2**20:.1f} | "
            f"{many.rss_end / 2**20:.1f} | {many.cpu:.1f} | {many.restarts} |",
        ]
    if any(r.gc for r in results):
        out += [
            "",
            "Operator garbage collections per iteration (gc.callbacks): count, pause ms, objects freed; the "
            "longest pause is over the whole run of that pod count",
            "",
            "| pods | generation | collections | pause ms | freed | longest pause ms |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for r in results:
            for gen in sorted(r.gc):
                g = r.gc[gen]
                out.append(
                    f"| {r.pods} | {gen} | {g.get('n', 0):.1f} | {g.get('seconds', 0) * 1000:.1f} | "
                    f"{g.get('collected', 0):.0f} | {g.get('max', 0) * 1000:.1f} |"
                )
    for r in results:
        if r.profile:
            title = f"Operator profile, {r.pods} pods (py-spy, {r.profile})"
            out += ["", title, "", *profile_table(r.profile)]
    if not results:  # the many-jobs run alone (--sizes '')
        return "\n".join(out)
    # Counters absent at a size (nothing counted: "decisions skipped" at 1 pod) are 0 there.
    keys = list(
        dict.fromkeys(k for r in results for k in r.per_iteration if k != "CPU operator / pod / phase ms")
    )
    out += [
        "",
        "Per iteration (counters scraped from the operator's metrics endpoint; CPU seconds from /proc)",
        "",
        "| pods | iterations | iteration wall s | startup s | " + " | ".join(keys) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(keys),
    ]
    for r in results:
        got = collections.defaultdict(float, r.per_iteration)
        cells = [f"{got[k]:.1f}" if "CPU" not in k else f"{got[k]:.3f}" for k in keys]
        wall = r.window_seconds / r.iterations
        out.append(
            f"| {r.pods} | {r.iterations} | {wall:.2f} | {r.startup_seconds:.1f} | {' | '.join(cells)} |"
        )
    out += [
        "",
        f"Where the machine's {cores} cores went over the window (CPU s per iteration / iteration wall s): "
        "the stand-ins are the agents + emulators (their host processes) and the kubelet + trainers (this "
        "process); busy is the whole machine (/proc/stat)",
        "",
        "| pods | " + " | ".join(CPU_OF) + " | busy | stand-ins' share of the machine |",
        "|---:|" + "---:|" * (len(CPU_OF) + 2),
    ]
    for r in results:
        wall = r.window_seconds / r.iterations
        used = [r.per_iteration[f"CPU {k}"] / wall for k in CPU_OF]
        stand_ins = (r.per_iteration["CPU agents+emulators"] + r.per_iteration["CPU kubelet+trainers"]) / wall
        out.append(
            f"| {r.pods} | "
            + " | ".join(f"{u:.2f}" for u in used)
            + f" | {r.busy / r.window_seconds:.2f} | {stand_ins / cores:.0%} |"
        )
    for title, column, counts in (
        ("Operator API calls per iteration, by verb", "verb", [r.api_verbs for r in results]),
        (
            "Status writes per iteration, by top-level status field changed "
            "(rljob_status_fields_written_total)",
            "field",
            [r.status_fields for r in results],
        ),
        (
            "Agent commands sent per iteration, by action and outcome (rljob_agent_commands_total)",
            "action outcome",
            [r.commands for r in results],
        ),
    ):
        out += ["", title, "", *breakdown_table(column, [r.pods for r in results], counts)]
    big, small = max(results, key=lambda r: r.pods), min(results, key=lambda r: r.pods)
    if big is not small:
        out += [
            "",
            f"Ratios {big.pods} pods vs {small.pods} (medians of the overheads; per-iteration figures)",
            "",
            "| figure | ratio |",
            "|---|---:|",
        ]

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b > 0 else "n/a"

        for phase in TRANSITIONS:
            out.append(
                f"| overhead {phase} | "
                f"{ratio(statistics.median(big.overhead[phase]), statistics.median(small.overhead[phase]))} |"
            )
        for k in keys:
            big_k, small_k = big.per_iteration.get(k, 0.0), small.per_iteration.get(k, 0.0)
            out.append(f"| {k} / iteration | {ratio(big_k, small_k)} |")
    out += projection_table(results, many)
    if not probe:
        return "\n".join(out)
    out += [
        "",
        f"kube-apiserver: GET pods (label selector) right after a write to another object, ms, "
        f"{len(next(iter(probe.values())))} samples",
        "",
        "| list | p50 | p95 |",
        "|---|---:|---:|",
    ]
    for kind, values in probe.items():
        out.append(f"| {kind} | {_ms(statistics.median(values))} | {_ms(p95(values))} |")
    return "\n".join(out)


# Frames every sample passes through (thread and event-loop machinery): left out of the inclusive table.
GENERIC_FRAMES = ("threading.py", "runners.py", "<frozen runpy>", "running.py", "main.py:", "events.py:80")


def profile_table(path: str, top: int = 20) -> list[str]:
    """py-spy's collapsed stacks: the frames with the most samples, inclusive and on top (self)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] if "/" in f else f for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    if not total:
        return ["(no samples)"]
    rows = [f"{total} samples", "", "| frame | inclusive % | self % |", "|---|---:|---:|"]
    specific = [(f, n) for f, n in inclusive.most_common() if not any(g in f for g in GENERIC_FRAMES)]
    specific = [(f, n) for f, n in specific if "base_events.py" not in f]
    for frame, n in specific[:top]:
        rows.append(f"| `{frame}` | {100 * n / total:.1f} | {100 * own[frame] / total:.1f} |")
    rows += ["", "| frame (by self time) | self % |", "|---|---:|"]
    for frame, n in own.most_common(top):
        rows.append(f"| `{frame}` | {100 * n / total:.1f} |")
    return rows


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): per-pod CPU figures hold for that CPU only."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "an unknown CPU"


def run(
    sizes: Sequence[int],
    iterations: Sequence[int],
    json_path: Path | None = None,
    options: Options = Options(),
    many: tuple[int, int, float] | None = (100, 8, 1200.0),
) -> tuple[list[SizeResult], dict[str, list[float]], ManyResult | None]:
    work = Path(tempfile.mkdtemp(prefix="rljob-bench-overhead-"))
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    # The host processes inherit this process's open-file limit: raised as the operator raises its own.
    _, files = raise_open_file_limit()
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio's (no uvloop: not the operator's)"
    print(
        f"[machine: {os.cpu_count()} cores of {cpu_model()}; load average before the run {load}; "
        f"event loop {loop}; open files {files}]", flush=True,
    )  # fmt: skip
    results = []
    many_result = None
    with LocalControlPlane(work / "cluster", ensure_binaries(build=True)) as plane:
        bench = Bench(plane, work, options)
        probe = list_after_write(bench.api)
        for pods, n in zip(sizes, iterations, strict=True):
            began = time.monotonic()
            load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
            try:
                results.append(bench.run(pods, n))
            except RuntimeError as err:  # e.g. a gang restart in the window: the other sizes still run
                print(f"[{pods} pods: not measured: {err}]", flush=True)
                continue
            print(f"[{pods} pods: {n} iterations measured in {time.monotonic() - began:.0f}s; load before "
                  f"{load}; logs {work}]", flush=True)  # fmt: skip
            if json_path is not None:  # each size as it is measured: a later one may fail
                partial = json_path.with_suffix(f".{pods}.json")
                partial.write_text(json.dumps(asdict(results[-1]), indent=2))
        if many is not None:
            began = time.monotonic()
            try:
                many_result = bench.run_many(*many)
            except RuntimeError as err:  # a failed job: the sizes above are still printed
                print(f"[{many[0]} jobs x {many[1]} pods: not measured: {err}]", flush=True)
            else:
                print(f"[{many[0]} jobs x {many[1]} pods in {time.monotonic() - began:.0f}s]", flush=True)
                if json_path is not None:
                    json_path.with_suffix(".many.json").write_text(json.dumps(asdict(many_result), indent=2))
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"[load average after the run {load}]", flush=True)
    if json_path is not None:
        raw = {"sizes": [asdict(r) for r in results], "probe": probe}
        raw["many"] = asdict(many_result) if many_result else None
        json_path.write_text(json.dumps(raw, indent=2))
    return results, probe, many_result


def saved_results(
    paths: Sequence[Path],
) -> tuple[list[SizeResult], dict[str, list[float]], ManyResult | None]:
    """What `run` wrote with --json, size by size (a later size may have failed) or whole."""
    sizes: list[SizeResult] = []
    probe: dict[str, list[float]] = {}
    many: ManyResult | None = None
    for path in paths:
        raw = json.loads(path.read_text())
        if "sizes" in raw:
            sizes += [SizeResult(**r) for r in raw["sizes"]]
            probe = raw.get("probe") or probe
            many = ManyResult(**raw["many"]) if raw.get("many") else many
        elif "jobs" in raw:
            many = ManyResult(**raw)
        else:
            sizes.append(SizeResult(**raw))
    return sorted(sizes, key=lambda r: r.pods), probe, many


@pytest.mark.bench
def test_control_overhead(request: pytest.FixtureRequest) -> None:
    if "bench" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("benchmark: run with -m bench")
    print("\n" + tables(*run(DEFAULT_SIZES, DEFAULT_ITERATIONS)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="pod counts")
    p.add_argument("--iterations", default=",".join(map(str, DEFAULT_ITERATIONS)), help="measured, per size")
    p.add_argument("--many-jobs", type=int, default=100, help="RLJobs at once for the RSS figure (0: skip)")
    p.add_argument("--many-pods", type=int, default=8, help="pods of each of them")
    p.add_argument("--many-seconds", type=float, default=1200, help="how long the many-jobs run may take")
    p.add_argument("--json", type=Path, default=None, help="also write the raw samples here")
    p.add_argument("--profile", type=Path, default=None, help="py-spy the operator, stacks into this dir")
    p.add_argument("--gc-stats", action="store_true", help="time the operator's garbage collections")
    p.add_argument("--operator-source", type=Path, default=None, help="run the operator from DIR/operator")
    p.add_argument("--hosts", type=int, default=None, help="agent/emulator processes (default: host_count)")
    p.add_argument(
        "--from-json", type=Path, nargs="+", default=None,
        help="print the tables of earlier runs' files (F.<pods>.json, F.many.json) instead of measuring",
    )  # fmt: skip
    args = p.parse_args()
    if args.from_json:
        print(tables(*saved_results(args.from_json)))
        return
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    its = [int(s) for s in args.iterations.split(",")] if sizes else []
    if len(its) == 1:
        its *= len(sizes)
    options = Options(args.profile, args.gc_stats, args.operator_source, args.hosts)
    many = (args.many_jobs, args.many_pods, args.many_seconds) if args.many_jobs > 0 else None
    print(tables(*run(sizes, its, args.json, options, many)))


if __name__ == "__main__":
    main()
