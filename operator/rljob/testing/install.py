"""Install the Helm chart the way a user would, and run the operator with exactly the chart's rights.

Used by `make demo` and the e2e tests against the local control plane (`rljob.testing.cluster`):

- `install_chart` runs the real `helm upgrade --install` with charts/rljob-operator, pointing the
  operator at the watch namespaces (namespaced RBAC by default) and, for simulated pods, the agent's
  emulator GPU probe. The controller-manager creates the chart's Deployment pod and the scheduler binds
  it, but the fake kubelet runs only the watched namespaces' pods, so it stays Pending: the operator runs
  as a local process instead (below), with exactly the chart's rights.
- `operator_kubeconfig` mints a TokenRequest token for the chart's ServiceAccount and writes a
  kubeconfig with it, so a locally started `rljob-operator` has the chart's RBAC and nothing more.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rljob.testing.cluster import LocalControlPlane
from rljob.testing.kubeaccess import KubeApi, mint_token, write_kubeconfig

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "rljob-operator"
SERVICE_ACCOUNT = "rljob-operator"


class HelmError(RuntimeError):
    """helm exited non-zero; the message carries its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        said = stderr.strip() or stdout.strip()
        super().__init__(f"{' '.join(argv[:3])} ... failed ({returncode}):\n{said}")
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def chart_dir() -> Path:
    """charts/rljob-operator of the source checkout this module runs from."""
    if not (CHART / "Chart.yaml").is_file():
        raise FileNotFoundError(f"{CHART} not found: the chart ships with the source tree, not the wheel")
    return CHART


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` wins; nested mappings are merged key by key (lists are replaced, as helm does)."""
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = value
    return merged


def simulator_values(watch_namespaces: Sequence[str]) -> dict[str, Any]:
    """Values for the local control plane: watch exactly these namespaces with namespaced RBAC (all
    namespaces with cluster RBAC when none are given) and probe the emulator's GPU memory."""
    namespaces = list(watch_namespaces)
    return {
        "watchNamespaces": namespaces,
        "rbac": {"scope": "namespaced" if namespaces else "cluster"},
        "agent": {"gpuProbe": "rljob.emulator.probe:EmulatorProbe"},
    }


def helm_env(home: Path | None = None) -> dict[str, str]:
    """helm's environment: no proxies (loopback only) and, when `home` is given, helm's cache, config and
    data dirs under it instead of the user's."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    if home is not None:
        for sub in ("cache", "config", "data"):
            env[f"HELM_{sub.upper()}_HOME"] = str(home / sub)
    return env


def run_helm(
    helm: Path, args: Sequence[str], kubeconfig: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Runs `helm ARGS` (with --kubeconfig when given); raises HelmError on a non-zero exit."""
    argv = [str(helm), *args]
    if kubeconfig is not None:
        argv.append(f"--kubeconfig={kubeconfig}")
    with tempfile.TemporaryDirectory(prefix="rljob-helm-") as home:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=helm_env(Path(home)), check=False
        )
    if done.returncode != 0:
        raise HelmError(argv, done.returncode, done.stdout, done.stderr)
    return done


def install_chart(
    helm: Path,
    kubeconfig: Path,
    release: str,
    namespace: str,
    watch_namespaces: list[str],
    extra_values: dict[str, Any] | None = None,
    chart: Path | None = None,
    timeout: float = 120,
) -> str:
    """`helm upgrade --install RELEASE charts/rljob-operator -n NAMESPACE --create-namespace --wait=false`
    with `simulator_values(watch_namespaces)` deep-merged with `extra_values`. Returns helm's output."""
    values = deep_merge(simulator_values(watch_namespaces), extra_values or {})
    with tempfile.TemporaryDirectory(prefix="rljob-values-") as tmp:
        values_file = Path(tmp) / "values.json"  # JSON is YAML: no quoting surprises from --set
        values_file.write_text(json.dumps(values))
        done = run_helm(
            helm,
            [
                "upgrade",
                "--install",
                release,
                str(chart or chart_dir()),
                f"--namespace={namespace}",
                "--create-namespace",
                "--wait=false",
                f"--values={values_file}",
            ],
            kubeconfig,
            timeout,
        )
    return done.stdout + done.stderr


def uninstall_chart(helm: Path, kubeconfig: Path, release: str, namespace: str, timeout: float = 120) -> str:
    """`helm uninstall` (keeps the CRD, as every chart-crds/ CRD is kept). Returns helm's output."""
    args = ["uninstall", release, f"--namespace={namespace}", "--wait=false"]
    done = run_helm(helm, args, kubeconfig, timeout)
    return done.stdout + done.stderr


def operator_kubeconfig(
    api: KubeApi,
    plane: LocalControlPlane | None,
    namespace: str,
    out: Path,
    service_account: str = SERVICE_ACCOUNT,
    expiration_seconds: int = 86400,
) -> Path:
    """Mints a TokenRequest token for the chart's ServiceAccount (which must exist: install the chart
    first) and writes a kubeconfig with it to `out`. The server and CA come from `plane`, or from `api`'s
    own kubeconfig when `plane` is None (a reused cluster)."""
    token = mint_token(api, namespace, service_account, expiration_seconds)
    ca_pem: bytes | None
    if plane is not None:
        server, ca_pem = plane.server, plane.ca_file.read_bytes()
    else:
        server = api.access.server
        ca_pem = Path(api.access.ca_file).read_bytes() if api.access.ca_file else None
    return write_kubeconfig(out, server, token, ca_pem, user=service_account, namespace=namespace)
