"""Small, dependency-light access to a Kubernetes API server for the simulator and the e2e tests.

`KubeApi` is a thin JSON-over-HTTP client (requests, which the kubernetes client already depends
on) driven by any kubeconfig. The simulator uses it instead of the generated client so that it
handles raw objects, never fails on model deserialization and can close a watch from another
thread. The helpers create namespaces and ServiceAccounts and mint TokenRequest tokens, so the
operator can be run with exactly the rights a chart grants it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import requests
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

JsonObj = dict[str, Any]
T = TypeVar("T")


class ApiError(Exception):
    """A non-2xx answer from the API server; `status` is the HTTP code, `body` the Status object."""

    def __init__(self, status: int, body: Any, method: str, path: str) -> None:
        message = body.get("message", "") if isinstance(body, dict) else str(body)[:300]
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class ClusterAccess:
    """What a kubeconfig's current context resolves to."""

    server: str
    ca_file: str | None
    verify: bool
    token: str | None
    cert: tuple[str, str] | None
    namespace: str


def resolve_kubeconfig(kubeconfig: Path | str, context: str | None = None) -> ClusterAccess:
    cfg = k8s_client.Configuration()
    k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig), context=context, client_configuration=cfg
    )
    token = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
    if token and token.startswith("Bearer "):
        token = token[len("Bearer ") :]
    cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file and cfg.key_file else None
    contexts, active = k8s_config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig)
    )
    if context:
        active = next(c for c in contexts if c["name"] == context)
    namespace = active.get("context", {}).get("namespace", "default")
    return ClusterAccess(cfg.host, cfg.ssl_ca_cert, bool(cfg.verify_ssl), token, cert, namespace)


class KubeApi:
    """JSON REST calls against one API server. Thread-safe for concurrent requests."""

    def __init__(self, access: ClusterAccess, timeout: float = 30.0) -> None:
        self.access = access
        self.timeout = timeout
        self._local = threading.local()  # one requests.Session per thread (Session is not thread-safe)

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path | str, context: str | None = None) -> KubeApi:
        return cls(resolve_kubeconfig(kubeconfig, context))

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False  # loopback only: never route through an HTTP(S)_PROXY
            session.verify = (self.access.ca_file or True) if self.access.verify else False
            if self.access.cert:
                session.cert = self.access.cert
            if self.access.token:
                session.headers["Authorization"] = f"Bearer {self.access.token}"
            self._local.session = session
        return session

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> JsonObj:
        resp = self._session().request(
            method,
            self.access.server + path,
            params=params,
            data=None if body is None else json.dumps(body),
            headers={"Content-Type": content_type, "Accept": "application/json"},
            timeout=self.timeout,
        )
        try:
            payload: Any = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, payload, method, path)
        return payload if isinstance(payload, dict) else {"raw": payload}

    def get(self, path: str, **params: Any) -> JsonObj:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: JsonObj) -> JsonObj:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: JsonObj) -> JsonObj:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: JsonObj | None = None) -> JsonObj:
        return self.request("DELETE", path, body)

    def watch(
        self, path: str, resource_version: str, read_timeout: float = 2.0, field_selector: str = ""
    ) -> WatchStream:
        """Opens a watch from `resource_version`; see WatchStream."""
        params = {"watch": "true", "resourceVersion": resource_version, "allowWatchBookmarks": "true"}
        if field_selector:
            params["fieldSelector"] = field_selector
        resp = self._session().get(
            self.access.server + path, params=params, stream=True, timeout=(5.0, read_timeout)
        )
        if resp.status_code >= 300:
            body = resp.text
            resp.close()
            raise ApiError(resp.status_code, body, "WATCH", path)
        return WatchStream(resp)


class WatchStream:
    """Iterates watch events (dicts with `type` and `object`). An idle period longer than the read
    timeout ends the iteration with requests' ConnectionError, so a caller can notice a stop flag
    and resume from the last resourceVersion it saw."""

    def __init__(self, resp: requests.Response) -> None:
        self._resp = resp

    def __iter__(self) -> Iterator[JsonObj]:
        # chunk_size=None yields data as it arrives (a fixed size would hold back small events).
        for line in self._resp.iter_lines(chunk_size=None):  # type: ignore[call-overload]
            if line:
                yield json.loads(line)

    def close(self) -> None:
        """Safe from another thread: shutting the socket down wakes a reader blocked on it."""
        with contextlib.suppress(Exception):
            self._resp.raw.shutdown()  # urllib3 >= 2.3
        self._resp.close()


def pod_path(namespace: str, name: str = "", sub: str = "") -> str:
    path = f"/api/v1/namespaces/{namespace}/pods"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def create_namespace(
    api: KubeApi, name: str, labels: Mapping[str, str] | None = None, timeout: float = 30.0
) -> JsonObj:
    """Creates the namespace and waits for its `default` ServiceAccount: the controller-manager creates it
    a moment later, and until then the ServiceAccount admission plugin refuses pods there. Upstream's e2e
    framework waits the same way (test/e2e/framework/framework.go:269@v1.34.4). `timeout=0` does not wait."""
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels or {})}}
    created = api.post("/api/v1/namespaces", body)
    if timeout > 0:
        wait_for(
            lambda: api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            timeout=timeout,
            what=f"ServiceAccount {name}/default (created by the controller-manager)",
        )
    return created


def delete_namespace(api: KubeApi, name: str, wait: float = 0.0) -> None:
    """Requests deletion; with `wait` > 0, waits that long for the namespace controller to finish it
    (every object deleted, pods terminated by their kubelet) and raises TimeoutError otherwise."""
    try:
        api.delete(f"/api/v1/namespaces/{name}", {"propagationPolicy": "Background"})
    except ApiError as exc:
        if exc.status != 404:
            raise
        return
    if wait > 0:
        left: list[str] = []

        def gone() -> bool:
            try:
                ns = api.get(f"/api/v1/namespaces/{name}")
            except ApiError as exc:
                if exc.status == 404:
                    return True
                raise
            # The namespace controller says what it still waits for (NamespaceContentRemaining, ...).
            conditions = ns.get("status", {}).get("conditions") or []
            left[:] = [c.get("message", "") for c in conditions if c.get("status") == "True"]
            return False

        try:
            wait_for(gone, timeout=wait, interval=0.25, what=f"namespace {name} deleted")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {'; '.join(left)}") from None


def ensure_service_account(api: KubeApi, namespace: str, name: str) -> JsonObj:
    body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
    try:
        return api.post(f"/api/v1/namespaces/{namespace}/serviceaccounts", body)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")


def mint_token(api: KubeApi, namespace: str, service_account: str, expiration_seconds: int = 86400) -> str:
    """A bound ServiceAccount token from the TokenRequest API (what `kubectl create token` does)."""
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": expiration_seconds},
    }
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
    token: str = api.post(path, body)["status"]["token"]
    return token


def write_kubeconfig(
    path: Path,
    server: str,
    token: str | None,
    ca_pem: bytes | None,
    user: str = "user",
    namespace: str = "default",
    client_cert: tuple[bytes, bytes] | None = None,
) -> Path:
    """A single-context kubeconfig with the CA embedded, authenticated by a bearer token or by a client
    certificate (`client_cert`: PEM certificate and key, embedded too)."""
    cluster: JsonObj = {"server": server}
    if ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    else:
        cluster["insecure-skip-tls-verify"] = True
    credentials: JsonObj = {}
    if token:
        credentials["token"] = token
    if client_cert:
        credentials["client-certificate-data"] = base64.b64encode(client_cert[0]).decode()
        credentials["client-key-data"] = base64.b64encode(client_cert[1]).decode()
    if not credentials:
        raise ValueError("write_kubeconfig needs a token or a client certificate")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rljob-local", "cluster": cluster}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [
            {"name": user, "context": {"cluster": "rljob-local", "user": user, "namespace": namespace}}
        ],
        "current-context": user,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path


def service_account_kubeconfig(
    admin_kubeconfig: Path | str,
    namespace: str,
    service_account: str,
    path: Path,
    create: bool = True,
    expiration_seconds: int = 86400,
) -> Path:
    """Writes a kubeconfig that authenticates as system:serviceaccount:<namespace>:<name>, with
    the cluster (server, CA) taken from the admin kubeconfig. It has exactly the SA's RBAC rights."""
    api = KubeApi.from_kubeconfig(admin_kubeconfig)
    if create:
        ensure_service_account(api, namespace, service_account)
    token = mint_token(api, namespace, service_account, expiration_seconds)
    ca_pem = Path(api.access.ca_file).read_bytes() if api.access.ca_file else None
    return write_kubeconfig(path, api.access.server, token, ca_pem, user=service_account, namespace=namespace)


def wait_for(
    probe: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.1, what: str = "condition"
) -> T:
    """Polls `probe` until it returns a truthy value (returned) or raises TimeoutError after `timeout`.
    Exceptions from `probe` count as "not yet"; the last one is reported on timeout."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = probe()
            if value:
                return value
            last = value
        except Exception as exc:  # not yet: e.g. the object does not exist yet
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached after {timeout}s (last: {last!r})")
        time.sleep(interval)


def kubectl_binary() -> Path | None:
    """The kubectl built from the control plane's release (hack/build-binaries.sh), if it is cached."""
    from rljob.testing.cluster import K8S_VERSION, binary_path  # late: cluster imports this module

    path = binary_path("kubectl", K8S_VERSION)
    return path if os.access(path, os.X_OK) else None


def kubectl_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) without proxies (loopback only), with the matching kubectl's
    directory first on PATH, so `kubectl` in any subprocess is the server's release (no skew warning)."""
    env = {k: v for k, v in (base or os.environ).items() if not k.lower().endswith("_proxy")}
    found = kubectl_binary()
    if found is not None:
        env["PATH"] = os.pathsep.join([str(found.parent), *filter(None, [env.get("PATH")])])
    return env


class Kubectl:
    """Runs the real kubectl against the test control plane: the one built from the server's release
    when it is cached (hack/build-binaries.sh), else the first on PATH."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.binary = str(kubectl_binary() or shutil.which("kubectl") or "kubectl")

    def __call__(
        self,
        *args: str,
        namespace: str | None = None,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        argv = [self.binary, f"--kubeconfig={kubeconfig or self.kubeconfig}"]
        if namespace:
            argv.append(f"--namespace={namespace}")
        argv += args
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(
                argv, input=input, capture_output=True, text=True, timeout=timeout, env=kubectl_env()
            )
            # `kubectl wait --for=condition=...` fails instead of waiting on an object whose status has
            # `conditions: null`, as a CRD's first revision does (pkg/cmd/wait/condition.go:54 in
            # k8s.io/kubectl@v0.34.4): a moment later the conditions are there, so ask again.
            racing = args[:1] == ("wait",) and ".status.conditions accessor error: <nil>" in done.stderr
            if not racing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}{done.stdout}")
        return done

    def json(self, *args: str, namespace: str | None = None, **kw: Any) -> Any:
        return json.loads(self(*args, "-o", "json", namespace=namespace, **kw).stdout)

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None, **kw: Any) -> str:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self("apply", "-f", "-", namespace=namespace, input=text, **kw).stdout
