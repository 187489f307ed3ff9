"""Chaos suite: faults injected into running RLJobs, and what became of the jobs. A benchmark-style report
(a table), not timed tests; exits 1 when a job did not end as expected or an invariant broke.

    make chaos
    .venv/bin/python tests/chaos/chaos.py [--seed 7] [--operator-kills 50] [--only operator,agent]
        [--engines sglang,vllm] [--json F]

What runs: a real kube-apiserver + etcd + scheduler + controller-manager (`LocalControlPlane`, cached
binaries), the fake kubelet running every pod's real agent (a native sidecar: the operator sees a 1.34
server), engine emulator (SGLang's for `engine: sglang` jobs, vLLM 0.26.0's for `engine: vllm` jobs) and
simulated trainer as their own processes, and the real operator process(es). Every lifecycle route is
slowed down a little and the rollout generates at 100 tokens/s, so that every phase lasts long enough to
be hit. Every scenario runs jobs of each engine of `--engines`. Faults, each scenario in its own namespace:

- operator: the operator SIGKILLed at `--operator-kills` seeded random moments (a random delay after its
  first status write since it started), restarted each time, new 5-iteration jobs (taking turns among the
  engines) coming while kills remain; then once more in each phase (Pending ... Resuming) the random
  moments missed;
- agent: one pod's agent SIGKILLed in each phase of a job per engine (the kubelet restarts it; it recovers
  from its record);
- engine: one pod's engine emulator SIGKILLed in each phase of a job per engine (a lost member: the gang
  restarts, within backoffLimit), then a job with backoffLimit 1 losing its engine twice (it must fail,
  BackoffLimitExceeded);
- standby: the chart's two replicas with leader election (tests/e2e/test_standby.py's harness), the
  active one SIGKILLed mid-iteration of a job per engine; the standby finishes them;
- apiserver: kube-apiserver restarted (etcd data kept) at seeded moments mid-iteration of a job per engine.

Measured per scenario, for every job: did it end as expected (Succeeded; Failed with the expected reason),
weight versions seen by a poller every 0.1 s and in weightHistory never going back, non-idempotent engine
calls repeated (each emulator appends its calls to a file in its pod's scratch dir, emulator/call_log.py:
SGLang's release of a released tag, resume of a resumed one, refit of a version already loaded; vLLM's
sleep while asleep, wake of what does not sleep, reload of a path already loaded), gang restarts
(status.restarts), engine restarts (emulator processes started beyond each job's first gang), agent
restarts (the sidecars' restartCount).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from rljob.controller.children import AGENT_CONTAINER
from rljob.emulator.call_log import CALL_LOG_ENV
from rljob.lifecycle.versions import is_newer
from rljob.testing.cluster import LocalControlPlane, ensure_binaries
from rljob.testing.harness import ROOT, OperatorProcess, get_rljob, rljob_path
from rljob.testing.install import HelmError, install_chart, uninstall_chart
from rljob.testing.kubeaccess import KubeApi, Kubectl, create_namespace, delete_namespace, kubectl_env
from rljob.testing.kubelet import Kubelet
from rljob.testing.pods import SIM_ARGS_ENV, rljob_mapping

sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from test_standby import chart_replicas, holder  # the standby harness of the e2e tier

PHASES = ("Initializing", "Rollout", "Draining", "Releasing", "Training", "Refitting", "Resuming")
LOCK_STEP = PHASES[2:]
FINISHED = ("Succeeded", "Failed")
# Each engine's lifecycle routes, slowed: its pause, release, resume, disk refit and continue.
LIFECYCLE_ROUTES = {
    "sglang": (
        "/pause_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/continue_generation",
    ),
    "vllm": ("/pause", "/sleep", "/wake_up", "/collective_rpc", "/resume"),
}
CALL_LOG = "engine-calls.jsonl"  # in the pod's scratch dir (the emulator's working directory)
EXAMPLES = {  # one example per engine, each refitted from disk here
    "sglang": yaml.safe_load((ROOT / "examples/rljob.yaml").read_text()),
    "vllm": yaml.safe_load((ROOT / "examples/rljob-vllm.yaml").read_text()),
}
ENGINES = tuple(EXAMPLES)


def job_manifest(
    name: str, iterations: int, backoff: int = 3, train_seconds: float = 0.3, engine: str = "sglang"
) -> dict[str, Any]:
    """The engine's example, 2 pods, refitted from disk, quick: what a user applies, sized for many short
    iterations."""
    manifest = copy.deepcopy(EXAMPLES[engine])
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec.update(replicas=2, iterations=iterations, backoffLimit=backoff, podsAfterFinished="Keep")
    spec["refit"] = {"source": "disk"}
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    rollout, trainer = spec["template"]["spec"]["containers"]
    slow = " ".join(f"--fault-slow {route}=0.2" for route in LIFECYCLE_ROUTES[engine])
    rollout["env"] = [
        *rollout.get("env", []),
        {"name": SIM_ARGS_ENV, "value": f"--tokens-per-second 100 {slow}"},
        {"name": CALL_LOG_ENV, "value": CALL_LOG},
    ]
    trainer["args"] = ["--prompts", "2", "--samples-per-prompt", "2", "--train-seconds", str(train_seconds)]
    return dict(manifest)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Row:
    scenario: str
    faults: int = 0
    jobs: int = 0
    converged: int = 0  # ended as expected: Succeeded, or Failed with the expected reason
    failed_as_expected: int = 0
    repeated_calls: int = 0
    regressions: int = 0
    gang_restarts: int = 0
    engine_restarts: int = 0
    agent_restarts: int = 0
    seconds: float = 0.0
    note: str = ""
    problems: list[str] = field(default_factory=list)


class VersionWatch:
    """Polls every RLJob of a namespace: a weightVersion lower than one seen before is a regression."""

    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.seen: dict[str, list[int]] = {}
        self.regressions: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> VersionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(Exception):  # the API server may be restarting
                for obj in self.api.get(rljob_path(self.namespace))["items"]:
                    version = (obj.get("status") or {}).get("weightVersion")
                    if version is None or not str(version).isdigit():
                        continue
                    history = self.seen.setdefault(obj["metadata"]["name"], [])
                    if history and int(version) < history[-1]:
                        self.regressions.append(f"{obj['metadata']['name']}: {history[-1]} -> {version}")
                    if not history or int(version) != history[-1]:
                        history.append(int(version))


class Chaos:
    def __init__(self, work: Path, seed: int, engines: tuple[str, ...] = ENGINES) -> None:
        self.work = work
        self.rng = random.Random(seed)
        self.engines = engines
        self.plane = LocalControlPlane(work / "cluster", ensure_binaries(build=True))
        self.rows: list[Row] = []

    # --- the world ---------------------------------------------------------------------------------

    def __enter__(self) -> Chaos:
        self.plane.start()
        os.environ["PATH"] = kubectl_env()["PATH"]
        self.api = KubeApi.from_kubeconfig(self.plane.kubeconfig)
        self.kubectl = Kubectl(self.plane.kubeconfig)
        self.kubectl("apply", "-f", str(ROOT / "crds"))
        self.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=30s")
        self.kubelet = Kubelet(
            self.plane.kubeconfig,
            [],
            rljob_mapping(),
            nodes=2,
            scratch_root=self.work / "pods",
            node_prefix="chaos",
        ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.kubelet.stop()
        self.plane.stop()

    @contextlib.contextmanager
    def scenario(self, name: str) -> Iterator[tuple[str, Row, VersionWatch]]:
        ns = f"chaos-{name}-{uuid.uuid4().hex[:4]}"
        create_namespace(self.api, ns)
        row = Row(name)
        began = time.monotonic()
        log(f"== {name} (namespace {ns})")
        try:
            with VersionWatch(self.api, ns) as watch:
                yield ns, row, watch
            row.regressions += len(watch.regressions)
            row.problems += [f"version went back: {r}" for r in watch.regressions]
        except Exception as e:  # the table still gets the row: a scenario that broke is a finding
            row.problems.append(f"{e.__class__.__name__}: {e}")
            log(f"{name}: {e.__class__.__name__}: {e}")
        finally:
            row.seconds = time.monotonic() - began
            self.rows.append(row)
            log(f"{name}: done in {row.seconds:.0f}s; problems: {row.problems or 'none'}")
            with contextlib.suppress(Exception):
                delete_namespace(self.api, ns)

    def operator(self, ns: str, name: str) -> OperatorProcess:
        return OperatorProcess(self.plane.kubeconfig, [ns], self.work / f"{name}.log").start()

    def apply(self, ns: str, manifest: dict[str, Any]) -> None:
        self.kubectl.apply(manifest, namespace=ns)

    def status(self, ns: str, job: str) -> dict[str, Any]:
        try:
            return dict(get_rljob(self.api, ns, job).get("status") or {})
        except Exception:  # restarting API server: no news
            return {}

    def wait(
        self, ns: str, job: str, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(ns, job)
            if predicate(st):
                return st
            time.sleep(0.02)
        st = self.status(ns, job)
        raise TimeoutError(
            f"{job}: not {what} after {timeout:.0f}s (phase {st.get('phase')}: {st.get('message')})"
        )

    def pods(self, ns: str, job: str) -> list[dict[str, Any]]:
        return list(
            self.api.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=f"rljob.io/job={job}")["items"]
        )

    def kill_container(self, ns: str, pod: str, container: str) -> None:
        runner = self.kubelet.runner(ns, pod)
        proc = runner.processes().get(container) if runner is not None else None
        if proc is None:
            raise RuntimeError(f"{ns}/{pod}: no {container} process to kill")
        os.killpg(proc.pid, signal.SIGKILL)

    # --- what the jobs did -------------------------------------------------------------------------

    def finish(self, ns: str, row: Row, jobs: dict[str, str | None], touches_engine: bool = False) -> None:
        """`jobs`: name -> the reason it must fail with (None: it must succeed)."""
        row.jobs = len(jobs)
        for job, fail_reason in jobs.items():
            want = "Failed" if fail_reason else "Succeeded"
            try:
                st = self.wait(ns, job, lambda s: s.get("phase") in ("Succeeded", "Failed"), 240, "finished")
            except TimeoutError as e:
                row.problems.append(str(e))
                continue
            row.gang_restarts += int(st.get("restarts", 0))
            ok = st.get("phase") == want and (fail_reason is None or st.get("reason") == fail_reason)
            row.converged += ok
            row.failed_as_expected += ok and fail_reason is not None
            if not ok:
                row.problems.append(
                    f"{job}: {st.get('phase')} ({st.get('reason')}: {st.get('message')}), want {want}"
                )
            history = [str(w["version"]) for w in st.get("weightHistory", [])]
            if not all(is_newer(v, history[:i]) for i, v in enumerate(history)):  # a vLLM job's "default"
                row.regressions += 1
                row.problems.append(f"{job}: weightHistory {history}")
            for pod in self.pods(ns, job):
                for c in (pod.get("status") or {}).get("initContainerStatuses") or []:
                    if c["name"] == AGENT_CONTAINER:
                        row.agent_restarts += int(c.get("restartCount", 0))
        repeats = self.repeated_calls(ns)
        row.repeated_calls = len(repeats)
        row.problems += [f"repeated call: {r['route']}({r['args']}): {r['repeat']}" for r in repeats]
        # Every pod runs one engine process (restartPolicy Never): the pods beyond each job's first gang.
        pods = [d for d in (self.work / "pods" / ns).glob("*-*") if d.is_dir() and d.name != "claims"]
        row.engine_restarts = len(pods) - 2 * len(jobs)
        if not touches_engine and row.engine_restarts:
            row.problems.append(f"{row.engine_restarts} engine restart(s) where no fault touched an engine")

    def repeated_calls(self, ns: str) -> list[dict[str, Any]]:
        """The repeated calls every emulator of the namespace logged, killed and deleted ones included."""
        repeats = []
        for path in sorted((self.work / "pods" / ns).glob(f"*/{CALL_LOG}")):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                if entry.get("repeat"):
                    repeats.append(entry)
        return repeats

    # --- the scenarios -----------------------------------------------------------------------------

    def operator_kills(self, kills: int) -> None:
        """`kills` at seeded random moments; then one more in each phase the random ones missed."""
        with self.scenario("operator") as (ns, row, _):
            op = self.operator(ns, "operator-kills")
            jobs: dict[str, str | None] = {}
            phases: Counter[str] = Counter()
            missed: list[str] = []

            def current(fresh: bool = False) -> str:
                name = list(jobs)[-1] if jobs else None
                if fresh or name is None or self.status(ns, name).get("phase") in ("Succeeded", "Failed"):
                    name, engine = f"op-{len(jobs)}", self.engines[len(jobs) % len(self.engines)]
                    self.apply(ns, job_manifest(name, iterations=5, engine=engine))
                    jobs[name] = None
                return name

            def kill(job: str) -> None:
                phases[self.status(ns, job).get("phase", "?")] += 1
                op.kill()
                row.faults += 1
                time.sleep(self.rng.uniform(0.0, 0.3))  # the world goes on without an operator
                op.start()

            try:
                for _ in range(kills):
                    job = current()
                    # A random moment of an operator at work: after its first write since it started.
                    self._first_write(ns, job, timeout=20)
                    time.sleep(self.rng.uniform(0.0, 1.2))
                    kill(job)
                missed = [p for p in ("Pending", *PHASES) if not phases[p]]
                for phase in missed:  # targeted: a new job for the phases a job passes once
                    job = current(fresh=phase in ("Pending", "Initializing"))
                    st = self.wait(ns, job, lambda s, p=phase: s.get("phase") in (p, *FINISHED), 120, phase)
                    if st.get("phase") in FINISHED:  # it finished first: the next job passes it
                        job = current(fresh=True)
                        self.wait(ns, job, lambda s, p=phase: s.get("phase") == p, 120, phase)
                    kill(job)
                self.finish(ns, row, jobs)
            finally:
                op.stop()
            targeted = (
                f" (the last {len(missed)} targeted at phases the random ones missed)" if missed else ""
            )
            row.note = f"{row.faults} kills{targeted}: " + ", ".join(
                f"{p} {n}" for p, n in phases.most_common()
            )

    def agent_kills(self) -> None:
        with self.scenario("agent") as (ns, row, _):
            op = self.operator(ns, "agent-kills")
            jobs: dict[str, str | None] = {}
            try:
                for engine in self.engines:  # one job at a time: each passes Initializing once
                    job = f"agent-{engine}"
                    jobs[job] = None
                    self.apply(ns, job_manifest(job, iterations=7, engine=engine))
                    for k, phase in enumerate(PHASES):
                        self.wait(
                            ns,
                            job,
                            lambda s, p=phase, i=k: s.get("phase") == p and s.get("iteration", 0) >= i,
                            120,
                            phase,
                        )
                        time.sleep(self.rng.uniform(0.0, 0.15))
                        victim = self.rng.choice([p["metadata"]["name"] for p in self.pods(ns, job)])
                        self.kill_container(ns, victim, AGENT_CONTAINER)
                        row.faults += 1
                self.finish(ns, row, jobs)
                if row.gang_restarts:
                    row.problems.append(f"{row.gang_restarts} gang restart(s) after agent kills")
                if row.agent_restarts != row.faults:
                    row.problems.append(f"{row.agent_restarts} agent restarts for {row.faults} kills")
            finally:
                op.stop()
            row.note = f"one kill in each of {', '.join(PHASES)}, of a job per engine"

    def engine_kills(self) -> None:
        with self.scenario("engine") as (ns, row, _):
            op = self.operator(ns, "engine-kills")
            jobs: dict[str, str | None] = {}
            try:
                for engine in self.engines:  # the engine's container is named as the engine (its default)
                    job = engine
                    jobs[job] = None
                    self.apply(ns, job_manifest(job, iterations=3, backoff=len(PHASES), engine=engine))
                    for k, phase in enumerate(PHASES):  # after the k-th gang restart, in the next phase
                        self.wait(
                            ns,
                            job,
                            lambda s, p=phase, n=k: s.get("phase") == p and s.get("restarts", 0) == n,
                            180,
                            phase,
                        )
                        time.sleep(self.rng.uniform(0.0, 0.15))
                        victim = self.rng.choice([p["metadata"]["name"] for p in self.pods(ns, job)])
                        self.kill_container(ns, victim, engine)
                        row.faults += 1
                    # One more job whose backoffLimit runs out: it must fail, and say why.
                    limit = f"limit-{engine}"
                    jobs[limit] = "BackoffLimitExceeded"
                    self.apply(ns, job_manifest(limit, iterations=3, backoff=1, engine=engine))
                    for n in range(2):
                        self.wait(
                            ns,
                            limit,
                            lambda s, n=n: s.get("phase") == "Rollout" and s.get("restarts", 0) == n,
                            180,
                            "Rollout",
                        )
                        victim = self.rng.choice([p["metadata"]["name"] for p in self.pods(ns, limit)])
                        self.kill_container(ns, victim, engine)
                        row.faults += 1
                self.finish(ns, row, jobs, touches_engine=True)
                if row.gang_restarts != row.faults - len(self.engines):  # each last kill fails its job
                    row.problems.append(f"{row.gang_restarts} gang restarts for {row.faults} engine kills")
            finally:
                op.stop()
            row.note = (
                f"one kill in each of {len(PHASES)} phases (backoffLimit {len(PHASES)}); then a job with "
                "backoffLimit 1 killed twice; for each engine"
            )

    def standby_takeover(self) -> None:
        with self.scenario("standby") as (ns, row, _):
            helm = ensure_binaries(build=True).helm
            release_ns = f"{ns}-op"
            install_chart(helm, self.plane.kubeconfig, "rljob", release_ns, [ns])
            (self.work / "standby").mkdir(parents=True, exist_ok=True)
            lease, (a, b) = chart_replicas(self.api, release_ns, ns, self.work / "standby")
            try:
                a.start()
                self._until(lambda: holder(self.api, release_ns, lease) == "replica-a", 60, "replica-a leads")
                b.start()
                jobs: dict[str, str | None] = {f"ha-{engine}": None for engine in self.engines}
                for job, engine in zip(jobs, self.engines, strict=True):
                    self.apply(ns, job_manifest(job, iterations=4, engine=engine))
                phase = self.rng.choice(LOCK_STEP)
                first = next(iter(jobs))  # the others are wherever they are then
                self.wait(
                    ns, first, lambda s: s.get("phase") == phase and s.get("iteration", 0) >= 2, 120, phase
                )
                a.kill()
                row.faults += 1
                killed = time.monotonic()
                self._until(lambda: holder(self.api, release_ns, lease) == "replica-b", 30, "takeover")
                takeover = time.monotonic() - killed
                self.finish(ns, row, jobs)
                if row.gang_restarts:
                    row.problems.append(f"{row.gang_restarts} gang restart(s) after the takeover")
                row.note = f"active replica killed in {phase}; standby led {takeover:.1f}s later (lease 6 s)"
            finally:
                a.stop()
                b.stop()
                with contextlib.suppress(HelmError):
                    uninstall_chart(helm, self.plane.kubeconfig, "rljob", release_ns)
                with contextlib.suppress(Exception):
                    delete_namespace(self.api, release_ns)

    def apiserver_restarts(self, restarts: int = 2) -> None:
        with self.scenario("apiserver") as (ns, row, _):
            op = self.operator(ns, "apiserver-restarts")
            downtime = []
            phases = []
            try:
                jobs: dict[str, str | None] = {f"api-{engine}": None for engine in self.engines}
                for job, engine in zip(jobs, self.engines, strict=True):
                    self.apply(ns, job_manifest(job, iterations=1 + restarts, engine=engine))
                first = next(iter(jobs))  # the others are wherever they are then
                for k in range(restarts):
                    phase = self.rng.choice(LOCK_STEP)
                    self.wait(
                        ns,
                        first,
                        lambda s, p=phase, i=k + 1: s.get("phase") == p and s.get("iteration", 0) >= i,
                        180,
                        phase,
                    )
                    downtime.append(self.plane.restart_apiserver(down_seconds=self.rng.uniform(0.5, 2.0)))
                    phases.append(phase)
                    row.faults += 1
                self.finish(ns, row, jobs)
                if row.gang_restarts:
                    row.problems.append(f"{row.gang_restarts} gang restart(s) after API server restarts")
            finally:
                op.stop()
            row.note = f"restarted in {', '.join(phases)}; down {', '.join(f'{d:.1f}s' for d in downtime)}"

    def _first_write(self, ns: str, job: str, timeout: float) -> None:
        """Until the job's object changes (the operator wrote its status) or it is finished."""
        version = get_rljob(self.api, ns, job)["metadata"]["resourceVersion"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            obj = get_rljob(self.api, ns, job)
            finished = (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if obj["metadata"]["resourceVersion"] != version or finished:
                return
            time.sleep(0.02)

    def _until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.05)


# --- the report ------------------------------------------------------------------------------------

HEADERS = (
    "SCENARIO",
    "FAULTS",
    "JOBS",
    "CONVERGED",
    "REPEATED-CALLS",
    "VERSION-REGRESSIONS",
    "GANG-RESTARTS",
    "ENGINE-RESTARTS",
    "AGENT-RESTARTS",
    "SECONDS",
)


def table(rows: list[Row]) -> str:
    cells = [HEADERS] + [
        (
            r.scenario,
            str(r.faults),
            str(r.jobs),
            f"{r.converged}/{r.jobs}",
            str(r.repeated_calls),
            str(r.regressions),
            str(r.gang_restarts),
            str(r.engine_restarts),
            str(r.agent_restarts),
            f"{r.seconds:.0f}",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(HEADERS))).rstrip() for c in cells]
    notes = [f"  {r.scenario}: {r.note}" for r in rows if r.note]
    return "\n".join([*lines, "", *notes])


SCENARIOS = ("operator", "agent", "engine", "standby", "apiserver")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--operator-kills", type=int, default=50)
    p.add_argument(
        "--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}"
    )
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated subset of {','.join(ENGINES)}: the engines whose jobs each scenario runs",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: a comma-separated subset of {','.join(ENGINES)}")
    began = time.monotonic()
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"[seed {args.seed}; engines {', '.join(engines)}; {os.cpu_count()} cores; "
        f"load average before the run {load}]",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="rljob-chaos-"))
    # The fake kubelet's warnings (an API server that is down, by design here) go to a file, not the table.
    logging.basicConfig(
        filename=work / "chaos.log", level=logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    with Chaos(work, args.seed, engines) as chaos:
        runs = {
            "operator": lambda: chaos.operator_kills(args.operator_kills),
            "agent": chaos.agent_kills,
            "engine": chaos.engine_kills,
            "standby": chaos.standby_takeover,
            "apiserver": chaos.apiserver_restarts,
        }
        for name in only:
            runs[name]()
    rows = chaos.rows
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nchaos report, seed {args.seed}, {when}, {time.monotonic() - began:.0f}s in all:\n")
    print(table(rows))
    problems = [f"{r.scenario}: {p}" for r in rows for p in r.problems]
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if problems:
        print("\nPROBLEMS:\n" + "\n".join(f"  {p}" for p in problems))
        print(f"(logs and pod scratch dirs kept in {work})")
        return 1
    print("\nevery job ended as expected; no repeated call, no version regression")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
