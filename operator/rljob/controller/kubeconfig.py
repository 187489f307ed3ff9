"""Where the API server is and how the operator proves who it is, read as client-go reads it, without a
Kubernetes client library (kopf imports the generated `kubernetes` client whenever it can, ~14 MiB of the
operator's RSS for nothing it uses: docs/benchmarks.md; controller/main.py keeps it out).

- In a pod: its ServiceAccount, as rest.InClusterConfig (k8s.io/client-go/rest/config.go@v0.34.4):
  https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, the mounted CA, and the token file, which
  the kubelet rotates: it is read again every TOKEN_SECONDS, as client-go's cachingTokenSource does.
- Elsewhere: the current context (or `context`) of $KUBECONFIG's files merged, the first file to name an
  entry winning (clientcmd's loading rules), else ~/.kube/config: server, CA, tls-server-name,
  insecure-skip-tls-verify, proxy-url; a client certificate, a token or tokenFile, basic auth, or an exec
  credential plugin (client.authentication.k8s.io ExecCredential), run again when what it gave expires
  or the API server answers 401. Relative paths are relative to the file that names them.

`Credentials` is the one source of both kopf's login (controller/handlers.py) and the operator's own
calls (controller/apiserver.py)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_SECONDS = 60.0  # client-go re-reads a token file at most every minute (transport/token_source.go)
EXEC_MARGIN_SECONDS = 30.0  # an exec credential is renewed this long before it expires


Entry = tuple[dict[str, Any], Path]  # a kubeconfig entry and the folder of the file that named it


class ConfigError(Exception):
    """No usable configuration: not in a pod, and no kubeconfig (or one that names nothing usable)."""


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig user's `exec`: a command that prints an ExecCredential."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = "client.authentication.k8s.io/v1"
    base: Path = Path()  # a relative command is relative to its kubeconfig, as a path

    def run(self) -> tuple[dict[str, Any], datetime | None]:
        """The credential's status and when it expires (None: never)."""
        command = self.command
        if os.sep in command and not os.path.isabs(command):
            command = str(self.base / command)
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        env = {**os.environ, **dict(self.env), "KUBERNETES_EXEC_INFO": json.dumps(info)}
        try:
            done = subprocess.run(
                [command, *self.args], env=env, capture_output=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ConfigError(f"exec credential plugin {self.command}: {err}") from None
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip()[-500:]
            raise ConfigError(f"exec credential plugin {self.command} exited {done.returncode}: {why}")
        try:
            status = json.loads(done.stdout)["status"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"exec credential plugin {self.command}: no ExecCredential status") from None
        expires = status.get("expirationTimestamp")
        return status, datetime.fromisoformat(expires) if expires else None


@dataclass
class Credentials:
    """The API server and the operator's identity to it. Files named here exist for the process's life
    (data given inline is written to a private temporary directory: TLS needs files)."""

    server: str
    ca_path: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    proxy_url: str | None = None
    certificate_path: str | None = None
    private_key_path: str | None = None
    username: str | None = None
    password: str | None = None
    token: str | None = None
    token_path: str | None = None
    exec_plugin: ExecPlugin | None = None
    namespace: str | None = None  # the context's namespace, or the pod's
    clock: Any = field(default=time.monotonic, repr=False)
    _read_at: float = field(default=float("-inf"), repr=False)
    _expires: datetime | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bearer(self) -> str | None:
        """The token to send now: a token file re-read every TOKEN_SECONDS, an exec credential renewed
        before it expires. Thread-safe (the leader election calls from a thread of its own)."""
        with self._lock:
            now = self.clock()
            if self.token_path and now - self._read_at >= TOKEN_SECONDS:
                self.token = Path(self.token_path).read_text().strip() or None
                self._read_at = now
            elif self.exec_plugin is not None and (self.token is None or self._expiring()):
                self._run_exec()
            return self.token

    def expiration(self) -> datetime | None:
        return self._expires

    def invalidate(self) -> None:
        """The API server answered 401: read the token file again, run the exec plugin again."""
        with self._lock:
            self._read_at = float("-inf")
            if self.exec_plugin is not None:
                self.token = None

    def headers(self) -> dict[str, str]:
        token = self.bearer()
        if token:
            return {"Authorization": f"Bearer {token}"}
        if self.username is not None:
            pair = base64.b64encode(f"{self.username}:{self.password or ''}".encode()).decode()
            return {"Authorization": f"Basic {pair}"}
        return {}

    def _expiring(self) -> bool:
        if self._expires is None:
            return False
        return (self._expires - datetime.now(UTC)).total_seconds() < EXEC_MARGIN_SECONDS

    def _run_exec(self) -> None:
        assert self.exec_plugin is not None
        status, self._expires = self.exec_plugin.run()
        self.token = status.get("token") or None
        if status.get("clientCertificateData") and self.certificate_path is None:
            # A client certificate is taken once, when the transport is first built (its TLS context).
            self.certificate_path = _private_file("client.crt", status["clientCertificateData"].encode())
            self.private_key_path = _private_file("client.key", status["clientKeyData"].encode())

    # --- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, kubeconfig: str | None = None, context: str | None = None) -> Credentials:
        """In a pod (and not told otherwise): its ServiceAccount; else the kubeconfig."""
        if kubeconfig is None and context is None and "KUBECONFIG" not in os.environ:
            in_pod = cls.in_cluster()
            if in_pod is not None:
                return in_pod
        return cls.from_kubeconfig(kubeconfig, context)

    @classmethod
    def in_cluster(
        cls, env: Mapping[str, str] = os.environ, root: Path = SERVICE_ACCOUNT
    ) -> Credentials | None:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port or not (root / "token").exists():
            return None
        if ":" in host:  # IPv6
            host = f"[{host}]"
        namespace = root / "namespace"
        return cls(
            server=f"https://{host}:{port}",
            ca_path=str(root / "ca.crt") if (root / "ca.crt").exists() else None,
            token_path=str(root / "token"),
            namespace=namespace.read_text().strip() if namespace.exists() else None,
        )

    @classmethod
    def from_kubeconfig(cls, paths: str | None = None, context: str | None = None) -> Credentials:
        files = [
            Path(p).expanduser() for p in (paths or os.environ.get("KUBECONFIG", "")).split(os.pathsep) if p
        ]
        if not files:
            files = [Path("~/.kube/config").expanduser()]
        current: str | None = None
        contexts: dict[str, Entry] = {}
        clusters: dict[str, Entry] = {}
        users: dict[str, Entry] = {}
        for path in files:
            if not path.exists():
                if paths:  # named explicitly: its absence is an error; in $KUBECONFIG it is skipped
                    raise ConfigError(f"kubeconfig {path} does not exist")
                continue
            doc = yaml.safe_load(path.read_text()) or {}
            current = current or doc.get("current-context")
            for table, key in ((contexts, "contexts"), (clusters, "clusters"), (users, "users")):
                for item in doc.get(key) or []:
                    kind = key[:-1]
                    table.setdefault(item["name"], ({**(item.get(kind) or {})}, path.parent))
        name = context or current
        if not name or name not in contexts:
            raise ConfigError(
                f"no usable kubeconfig context ({name or 'none set'}) in {os.pathsep.join(map(str, files))}"
            )
        ctx, _ = contexts[name]
        if ctx.get("cluster") not in clusters:
            raise ConfigError(f"kubeconfig context {name} names no known cluster")
        cluster, cluster_dir = clusters[ctx["cluster"]]
        user, user_dir = users.get(str(ctx.get("user")), ({}, Path()))
        exec_spec = user.get("exec")
        token_file = user.get("tokenFile")
        token = user.get("token") or ((user.get("auth-provider") or {}).get("config") or {}).get(
            "access-token"
        )
        return cls(
            server=str(cluster["server"]).rstrip("/"),
            ca_path=_file_or_data(cluster, "certificate-authority", cluster_dir, "ca.crt"),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            tls_server_name=cluster.get("tls-server-name"),
            proxy_url=cluster.get("proxy-url"),
            certificate_path=_file_or_data(user, "client-certificate", user_dir, "client.crt"),
            private_key_path=_file_or_data(user, "client-key", user_dir, "client.key"),
            username=user.get("username"),
            password=user.get("password"),
            token=None if token_file else token,
            token_path=str(user_dir / token_file) if token_file else None,
            exec_plugin=ExecPlugin(
                command=exec_spec["command"],
                args=tuple(exec_spec.get("args") or ()),
                env=tuple((e["name"], e["value"]) for e in exec_spec.get("env") or ()),
                api_version=exec_spec.get("apiVersion", ExecPlugin.api_version),
                base=user_dir,
            )
            if exec_spec
            else None,
            namespace=ctx.get("namespace"),
        )


def _file_or_data(entry: Mapping[str, Any], key: str, base: Path, name: str) -> str | None:
    """`key` (a path, relative to its kubeconfig) or `key-data` (base64), as a file's path."""
    if entry.get(f"{key}-data"):
        return _private_file(name, base64.b64decode(entry[f"{key}-data"]))
    if entry.get(key):
        return str(base / Path(entry[key]).expanduser())
    return None


_PRIVATE_DIR: str | None = None


def _private_file(name: str, data: bytes) -> str:
    global _PRIVATE_DIR
    if _PRIVATE_DIR is None:
        _PRIVATE_DIR = tempfile.mkdtemp(prefix="rljob-credentials-")  # mode 0700
    fd, path = tempfile.mkstemp(prefix=name, dir=_PRIVATE_DIR)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
