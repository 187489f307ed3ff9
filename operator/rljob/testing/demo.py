"""`make demo`: the whole loop on a real local control plane with simulated GPU nodes.

Brings up etcd, kube-apiserver, kube-scheduler and kube-controller-manager (cached binaries), a fake
kubelet with two 8-GPU nodes, installs the chart (CRD, RBAC, operator settings) with helm, runs the
operator as the chart's ServiceAccount, applies examples/rljob.yaml with kubectl (v1.34.4, the server's
release), shows where the scheduler placed the gang, prints a live table, then `kubectl get rljob` and
`kubectl rljob status`. A second, rollout-bound job (examples/rljob-rollout-bound.yaml) runs beside it:
its `kubectl rljob status` and `kubectl rljob profile` name other levers than the first's."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rljob.testing.cluster import LocalControlPlane, ensure_binaries, nodes_table
from rljob.testing.harness import ROOT, OperatorProcess, get_rljob
from rljob.testing.install import install_chart, operator_kubeconfig
from rljob.testing.kubeaccess import KubeApi, create_namespace, kubectl_env, wait_for
from rljob.testing.kubelet import Kubelet
from rljob.testing.pods import rljob_mapping

NAMESPACE = "rljob-demo"
JOB = "demo"
ROLLOUT_EXAMPLE, ROLLOUT_JOB = "examples/rljob-rollout-bound.yaml", "demo-rollout"


def _kubectl(kubeconfig: Path, *args: str) -> str:
    """The server's kubectl (first on PATH), with the venv's bin on PATH for the `kubectl rljob` plugin."""
    env = kubectl_env({**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    env["KUBECONFIG"] = str(kubeconfig)
    out = subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, check=False)
    return out.stdout + out.stderr


def _release_note(obj: dict, spans: list[dict], at: int) -> str:
    """A Releasing span that ended: what the gang freed, and whether every GPU of every pod met the job's
    `release.verify`. The operator enters Training only once every pod's agent verified its release
    (lifecycle/evidence.py, `memory_verified`); a pod's `freedBytes` is the least any of its GPUs freed,
    so one below `minFreedBytes` names the pod. Any other outcome is not reported as verified."""
    st = obj.get("status", {})
    freed = f"freed {(spans[at].get('freedBytes') or 0) / 2**30:.0f} GiB"
    need = int(obj.get("spec", {}).get("release", {}).get("verify", {}).get("minFreedBytes") or 0)
    pods = st.get("pods", [])
    below = {p["name"] for p in pods if (p.get("freedBytes") or 0) < need}
    then = spans[at + 1]["phase"] if at + 1 < len(spans) else st.get("phase")
    if then == "Training" and not below:
        return f"{freed}, verified on every GPU of every pod"
    named = [
        f"{p['name']} (its GPU that freed least: {(p.get('freedBytes') or 0) / 2**30:.1f} GiB"
        + (f", minFreedBytes {need / 2**30:.1f} GiB" if p["name"] in below else "")
        + (f"; {p['lastError']}" if p.get("lastError") else "")
        + ")"
        for p in pods
        if p["name"] in below or p.get("lastError")
    ]
    if named:
        return f"{freed}, not verified on: {', '.join(named)}"
    return f"{freed}, not shown verified on every GPU: Releasing was followed by {then}"


def _new_rows(obj: dict, printed: set[tuple[str, str]]) -> list[str]:
    """One line per phase as it ends (from status.timeline), so even 30 ms phases show up."""
    st = obj.get("status", {})
    rows = []
    spans = st.get("timeline", [])
    for at, span in enumerate(spans):
        key = (span["phase"], span["startTime"])
        if span.get("seconds") is None or key in printed:
            continue
        if span["phase"] == "Releasing" and at + 1 == len(spans) and st.get("phase") == "Releasing":
            continue  # the next phase tells whether it was verified: printed once it is in the timeline
        printed.add(key)
        extra = ""
        if span["phase"] == "Releasing":
            extra = _release_note(obj, spans, at)
        if span.get("cacheHitRate") is not None:
            extra = (
                f"prefix-cache hit {span['cacheHitRate']:.0%}, {span.get('tokensPerSecond') or 0:.0f} tok/s"
            )
        if span["phase"] == "Resuming":  # the commit that ended this phase
            done = [
                w for w in st.get("weightHistory", []) if (w.get("committedAt") or "") >= span["startTime"]
            ]
            extra = f"serving weights {done[0]['version']} on every pod" if done else ""
        agent = f"{span['agentSeconds'] * 1000:8.0f}" if span.get("agentSeconds") is not None else "       -"
        rows.append(
            f"{span['iteration']:>4}  {span['phase']:10}  {span['seconds'] * 1000:7.0f}  {agent}  {extra}"
        )
    return rows


def run(timeout: float) -> int:
    binaries = ensure_binaries(build=True)
    work = Path(tempfile.mkdtemp(prefix="rljob-demo-"))
    components = "etcd, kube-apiserver, kube-scheduler, kube-controller-manager"
    print(f"== control plane: {components} ({work})", flush=True)
    with LocalControlPlane(work / "cluster", binaries) as plane:
        kubeconfig = plane.kubeconfig
        api = KubeApi.from_kubeconfig(kubeconfig)
        print(_kubectl(kubeconfig, "version").strip(), flush=True)
        create_namespace(api, NAMESPACE)
        print("== helm install rljob-operator (CRD, ServiceAccount, RBAC)", flush=True)
        print(
            install_chart(
                binaries.helm,
                kubeconfig,
                release="rljob",
                namespace="rljob-system",
                watch_namespaces=[NAMESPACE],
            ).strip(),
            flush=True,
        )
        sa_kubeconfig = operator_kubeconfig(
            api, plane, namespace="rljob-system", out=work / "operator.kubeconfig"
        )
        with (
            Kubelet(kubeconfig, [NAMESPACE], mapping=rljob_mapping(), scratch_root=work / "pods") as kubelet,
            OperatorProcess(sa_kubeconfig, [NAMESPACE], work / "operator.log") as operator,
        ):
            print(f"== fake kubelet, simulated GPU nodes\n$ kubectl get nodes\n{nodes_table(kubeconfig)}")
            print(
                "== kubectl apply -f examples/rljob.yaml  (operator runs as the chart's ServiceAccount)",
                flush=True,
            )
            print(
                _kubectl(
                    kubeconfig, "apply", "-n", NAMESPACE, "-f", str(ROOT / "examples/rljob.yaml")
                ).strip()
            )
            # A second trainer, rollout-bound, for a second diagnosis (kubectl rljob status/profile below).
            print(f"$ kubectl apply -f {ROLLOUT_EXAMPLE}")
            print(_kubectl(kubeconfig, "apply", "-n", NAMESPACE, "-f", str(ROOT / ROLLOUT_EXAMPLE)).strip())
            replicas = int(get_rljob(api, NAMESPACE, JOB)["spec"]["replicas"])

            def placed() -> bool:
                pods = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods", labelSelector=f"rljob.io/job={JOB}")
                return sum(1 for p in pods["items"] if p["spec"].get("nodeName")) >= replicas

            try:  # the scheduler binds the gang to nodes with a free nvidia.com/gpu
                wait_for(placed, timeout=60, interval=0.2, what="the gang bound to nodes")
            except TimeoutError as exc:
                print(f"{exc}\n" + _kubectl(kubeconfig, "get", "events", "-n", NAMESPACE), flush=True)
            columns = (
                "custom-columns=NAME:.metadata.name,NODE:.spec.nodeName,"
                "GPU:.spec.containers[0].resources.limits.nvidia\\.com/gpu"
            )
            print(f"\n$ kubectl get pods  (placed by kube-scheduler on {', '.join(kubelet.node_names)})")
            print(_kubectl(kubeconfig, "get", "pods", "-n", NAMESPACE, "-o", columns).rstrip(), flush=True)
            print("\nITER  PHASE       WALL-ms  AGENT-ms", flush=True)
            printed: set[tuple[str, str]] = set()
            deadline = time.monotonic() + timeout
            phase = rollout_phase = ""
            done = ("Succeeded", "Failed")
            while time.monotonic() < deadline and not (phase in done and rollout_phase in done):
                obj = get_rljob(api, NAMESPACE, JOB)
                phase = obj.get("status", {}).get("phase", "")
                rollout_phase = get_rljob(api, NAMESPACE, ROLLOUT_JOB).get("status", {}).get("phase", "")
                for row in _new_rows(obj, printed):
                    print(row, flush=True)
                if not operator.alive:
                    print("operator exited:\n" + operator.log_tail(), flush=True)
                    return 1
                time.sleep(0.2)
            status = obj.get("status", {})
            print(f"{phase}: {status.get('message', '')}", flush=True)
            print(f"{ROLLOUT_JOB}: {rollout_phase}", flush=True)
            print("\n$ kubectl get rljob -o wide")
            print(_kubectl(kubeconfig, "get", "rljob", "-n", NAMESPACE, "-o", "wide").rstrip())
            print(f"\n$ kubectl rljob status {JOB}")
            print(_kubectl(kubeconfig, "rljob", "-n", NAMESPACE, "status", JOB).rstrip())
            print(f"\n$ kubectl describe rljob {JOB} | tail (events)")
            described = _kubectl(kubeconfig, "describe", "rljob", "-n", NAMESPACE, JOB).rstrip().splitlines()
            print("\n".join(described[-14:]))
            print(f"\n$ kubectl rljob status {ROLLOUT_JOB} | tail (its last iteration and levers)")
            shown = (
                _kubectl(kubeconfig, "rljob", "-n", NAMESPACE, "status", ROLLOUT_JOB).rstrip().splitlines()
            )
            print("\n".join(shown[next((i for i, x in enumerate(shown) if x.startswith("Last it")), 0) :]))
            report = work / f"{ROLLOUT_JOB}-profile.html"
            print(f"\n$ kubectl rljob profile {ROLLOUT_JOB} --html {report}")
            print(
                _kubectl(kubeconfig, "rljob", "-n", NAMESPACE, "profile", ROLLOUT_JOB, "--html", str(report))
            )
            ok = phase == "Succeeded" and rollout_phase == "Succeeded"
            print(
                f"\n== demo {'succeeded' if ok else 'did not succeed: ' + phase}; logs in {work}", flush=True
            )
            return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="rljob-demo", description=__doc__)
    parser.add_argument("--timeout", type=float, default=300)
    sys.exit(run(parser.parse_args().timeout))


if __name__ == "__main__":
    main()
