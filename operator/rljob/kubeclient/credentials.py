"""Where the API server is and how the operator proves who it is, read by the official `kubernetes`
library's config loaders (`kubernetes.config`), the calls going out over this package's own transport
(apiserver.py):

- In a pod: its ServiceAccount (`load_incluster_config`): the mounted CA, and the token file, which the
  kubelet rotates; the library reads it again once a minute.
- Elsewhere: the current context (or `context`) of $KUBECONFIG's files merged, else ~/.kube/config
  (`load_kube_config`): server, CA, tls-server-name, insecure-skip-tls-verify, proxy-url; a client
  certificate, a token or tokenFile, basic auth, an auth-provider's token, or an exec credential plugin,
  run again by the library once what it gave expired.

`Credentials` is the one source of kopf's login (controller/handlers.py), the operator's own calls and the
kubectl plugin's; a 401 loads the configuration again (a rotated token file, an exec plugin run again)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.config.config_exception import ConfigException

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_KEY = "BearerToken"  # where both loaders put the Authorization header's value
ASK_SECONDS = 1.0  # how stale the header may be (a 401 asks at once; the cost of asking: docs/install.md)


class ConfigError(Exception):
    """No usable configuration: not in a pod, and no kubeconfig (or one that names nothing usable)."""


@dataclass
class Credentials:
    """The API server and the operator's identity to it, from a `kubernetes.client.Configuration` that
    `loader` fills (and fills again after a 401). Files named here exist for the process's life (the library
    writes inline data to temporary files: TLS needs files)."""

    server: str
    ca_path: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    proxy_url: str | None = None
    certificate_path: str | None = None
    private_key_path: str | None = None
    namespace: str | None = None  # the context's namespace, or the pod's
    loader: Callable[[], Any] | None = field(default=None, repr=False)  # -> a loaded Configuration
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _config: Any = field(default=None, repr=False)
    _value: str | None = field(default=None, repr=False)
    _asked_at: float = field(default=float("-inf"), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_configuration(cls, loader: Callable[[], Any], namespace: str | None) -> Credentials:
        config = loader()
        return cls(
            server=str(config.host).rstrip("/"),
            ca_path=config.ssl_ca_cert,
            insecure=not config.verify_ssl,
            tls_server_name=getattr(config, "tls_server_name", None),
            proxy_url=config.proxy,
            certificate_path=config.cert_file,
            private_key_path=config.key_file,
            namespace=namespace,
            loader=loader,
            _config=config,
        )

    def authorization(self) -> str | None:
        """The Authorization header's value ("Bearer …", "Basic …"), through the library's refresh hook (a
        token file read again every minute, an expired exec credential renewed) at most every
        ASK_SECONDS. Thread-safe: the leader election calls from a thread of its own."""
        with self._lock:
            if self._config is None:
                return None
            now = self.clock()
            if now - self._asked_at >= ASK_SECONDS:
                self._value = self._config.get_api_key_with_prefix(API_KEY) or None
                self._asked_at = now
            return self._value

    def bearer(self) -> str | None:
        scheme, _, value = (self.authorization() or "").partition(" ")
        return value if scheme.lower() == "bearer" and value else None

    def headers(self) -> dict[str, str]:
        value = self.authorization()
        return {"Authorization": value} if value else {}

    def invalidate(self) -> None:
        """The API server answered 401: load the configuration again (files re-read, plugins re-run)."""
        if self.loader is None:
            return
        config = self.loader()
        with self._lock:
            self._config, self._asked_at = config, float("-inf")

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
        if not env.get("KUBERNETES_SERVICE_HOST") or not (root / "token").exists():
            return None

        def load() -> Any:
            config = k8s_client.Configuration()
            loader = k8s_config.incluster_config.InClusterConfigLoader(  # type: ignore[no-untyped-call]
                token_filename=str(root / "token"), cert_filename=str(root / "ca.crt"), environ=env
            )
            with _config_errors("in-cluster configuration"):
                loader.load_and_set(config)  # type: ignore[no-untyped-call]
            return config

        namespace = root / "namespace"
        return cls.from_configuration(load, namespace.read_text().strip() if namespace.exists() else None)

    @classmethod
    def from_kubeconfig(cls, paths: str | None = None, context: str | None = None) -> Credentials:
        files = paths or os.environ.get("KUBECONFIG") or "~/.kube/config"
        if paths:  # named explicitly: a missing file is an error (in $KUBECONFIG it is skipped)
            _require_files(paths)

        def load() -> Any:
            config = k8s_client.Configuration()
            with _config_errors(f"kubeconfig {files}"):
                k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=files, context=context, client_configuration=config, persist_config=False
                )
            return config

        with _config_errors(f"kubeconfig {files}"):
            contexts, current = k8s_config.list_kube_config_contexts(config_file=files)  # type: ignore[no-untyped-call]
        chosen = next((c for c in contexts if c["name"] == context), None) if context else current
        return cls.from_configuration(load, _namespace_of(chosen))


def _require_files(paths: str) -> None:
    for p in filter(None, paths.split(os.pathsep)):
        if not Path(p).expanduser().exists():
            raise ConfigError(f"kubeconfig {p} does not exist")


def _namespace_of(context: dict[str, Any] | None) -> str | None:
    """The namespace a kubeconfig context names, None when it names none."""
    return ((context or {}).get("context") or {}).get("namespace")


@contextmanager
def _config_errors(what: str) -> Iterator[None]:
    """The library's ConfigException as ConfigError; and what it only logs (an exec plugin that failed:
    kube_config.py logs it and goes on without a credential) raised with its words."""
    logged: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                logged.append(record.getMessage())

    handler = Collect()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    except (ConfigException, OSError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{what}: {err}") from None
    finally:
        root.removeHandler(handler)
    if logged:
        raise ConfigError(f"{what}: {'; '.join(logged)}")
