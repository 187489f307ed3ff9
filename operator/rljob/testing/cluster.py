"""A real, local Kubernetes control plane for tests and the demo: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager.

The binaries are built from Go modules by hack/build-binaries.sh into a per-version cache
(docs/control-plane.md). `LocalControlPlane` starts them on loopback with free ports: the API server with
RBAC, a ServiceAccount issuer and signing key, an admin token (group system:masters) and client-certificate
authentication; the scheduler and the controller-manager each with their own client certificate
(system:kube-scheduler, system:kube-controller-manager), so the built-in RBAC roles apply to them as in a
kubeadm cluster. Nodes come from the fake kubelet (rljob.testing.kubelet). Processes run in their own
sessions so they can outlive the CLI (`up`) and be stopped as whole process groups (`down`).

CLI:  python -m rljob.testing.cluster up [--nodes 2 --gpus-per-node 8] | down | status [--dir .cluster]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rljob.testing.kubeaccess import write_kubeconfig

# Pinned versions; hack/k8s/go.mod and hack/etcd/go.mod must agree (a unit test checks it).
K8S_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"
HELM_VERSION = "v3.22.0"

STATE_FILE = "state.json"
MARKER_FILE = ".rljob-cluster"  # `down` only deletes a directory that carries this marker


class ControlPlaneError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("RLJOB_CACHE") or Path.home() / ".cache" / "rljob")


def binary_path(name: str, version: str) -> Path:
    return cache_dir() / "bin" / f"{name}-{version}" / name


def build_script() -> Path | None:
    """hack/build-binaries.sh of the source checkout this module runs from (absent when installed)."""
    script = Path(__file__).resolve().parents[3] / "hack" / "build-binaries.sh"
    return script if script.is_file() else None


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    helm: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kubectl: Path


def cached_binaries() -> Binaries:
    """Where hack/build-binaries.sh puts each binary (present or not)."""
    return Binaries(
        etcd=binary_path("etcd", ETCD_VERSION),
        kube_apiserver=binary_path("kube-apiserver", K8S_VERSION),
        helm=binary_path("helm", HELM_VERSION),
        kube_scheduler=binary_path("kube-scheduler", K8S_VERSION),
        kube_controller_manager=binary_path("kube-controller-manager", K8S_VERSION),
        kubectl=binary_path("kubectl", K8S_VERSION),
    )


def ensure_binaries(build: bool = True) -> Binaries:
    """Returns the cached binaries, building missing ones with hack/build-binaries.sh if allowed."""
    found = cached_binaries()
    missing = [p for p in asdict(found).values() if not os.access(p, os.X_OK)]
    if not missing:
        return found
    script = build_script()
    if not build or script is None:
        raise ControlPlaneError(
            f"missing binaries {[str(p) for p in missing]}; build them with hack/build-binaries.sh "
            "(needs Go and the Go module proxy)"
        )
    print(f"rljob.testing.cluster: building missing binaries with {script}", file=sys.stderr, flush=True)
    result = subprocess.run(["bash", str(script)], check=False)
    still = [p for p in asdict(found).values() if not os.access(p, os.X_OK)]
    if result.returncode != 0 or still:
        raise ControlPlaneError(f"{script} failed (exit {result.returncode}); missing {still}")
    return found


_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the child when the thread that started it dies, so a crashed
    test run never leaves etcd, kube-apiserver or pod processes behind."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


# Client certificates the CA signs: file stem -> (CN = user name, O = group). The CNs are the users the
# built-in RBAC roles are bound to (system:kube-scheduler, system:kube-controller-manager).
CLIENT_CERTS = {
    "kube-scheduler": ("system:kube-scheduler", ""),
    "kube-controller-manager": ("system:kube-controller-manager", ""),
}


def generate_pki(pki: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost, the components' client certificates and the
    ServiceAccount signing key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
             "-days", "3650", "-subj", "/CN=rljob-local-ca")  # fmt: skip
    _openssl("req", *ec, "-keyout", str(pki / "apiserver.key"), "-out", str(pki / "apiserver.csr"),
             "-subj", "/CN=kube-apiserver")  # fmt: skip
    (pki / "apiserver.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(pki / "ca.crt"),
             "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
             "-extfile", str(pki / "apiserver.ext"), "-out", str(pki / "apiserver.crt"))  # fmt: skip
    (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for stem, (user, group) in CLIENT_CERTS.items():
        subject = f"/CN={user}" + (f"/O={group}" if group else "")
        _openssl("req", *ec, "-keyout", str(pki / f"{stem}.key"), "-out", str(pki / f"{stem}.csr"),
                 "-subj", subject)  # fmt: skip
        _openssl("x509", "-req", "-in", str(pki / f"{stem}.csr"), "-CA", str(pki / "ca.crt"),
                 "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
                 "-extfile", str(pki / "client.ext"), "-out", str(pki / f"{stem}.crt"))  # fmt: skip
    # The request-header (front proxy) CA the API server publishes in kube-system/extension-apiserver-
    # authentication, where the scheduler's and controller-manager's delegated authentication looks for
    # it. It signs no certificate: nothing here is an aggregating proxy.
    _openssl("req", "-x509", *ec, "-keyout", str(pki / "front-proxy-ca.key"),
             "-out", str(pki / "front-proxy-ca.crt"), "-days", "3650",
             "-subj", "/CN=rljob-front-proxy-ca")  # fmt: skip
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki / "sa.key"))
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    for key in pki.glob("*.key"):
        key.chmod(0o600)


@dataclass
class ControlPlaneState:
    etcd_pid: int
    apiserver_pid: int
    scheduler_pid: int
    controller_manager_pid: int
    etcd_port: int
    apiserver_port: int
    scheduler_port: int
    controller_manager_port: int
    admin_token: str
    k8s_version: str
    etcd_version: str
    kubelet_pid: int = 0  # the CLI's fake kubelet (`up --nodes N`); 0 when none runs

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def pids(self) -> list[int]:
        """In stopping order: the kubelet, the clients of the API server, the API server, etcd."""
        order = (self.kubelet_pid, self.scheduler_pid, self.controller_manager_pid, self.apiserver_pid)
        return [pid for pid in (*order, self.etcd_pid) if pid]


def _pid_alive(pid: int, marker: str) -> bool:
    """True when `pid` runs and its command line mentions `marker` (guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return marker.encode() in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z"


def _stop_group(pid: int, marker: str, timeout: float = 10.0) -> None:
    """SIGTERM the process group led by `pid`, then SIGKILL what is left after `timeout`."""
    if not _pid_alive(pid, marker):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _pid_alive(pid, marker):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _pid_alive(pid, marker):
        time.sleep(0.05)


# The scheduler's volume plugins need bound PersistentVolumes (or CSI drivers), and a pod whose claim does
# not exist never schedules (pkg/scheduler/framework/plugins/volumebinding/volume_binding.go:324@v1.34.4).
# The fake kubelet gives each claim a directory instead, so these plugins are off; every other default
# plugin (resources fit, taints, affinity, spreading, ...) runs.
SCHEDULER_DISABLED_PLUGINS = ("VolumeBinding", "VolumeRestrictions", "VolumeZone", "NodeVolumeLimits")


class LocalControlPlane:
    """etcd, kube-apiserver, kube-scheduler and kube-controller-manager under `workdir`. Use as a context
    manager, or start()/stop()."""

    def __init__(
        self, workdir: Path | str, binaries: Binaries | None = None, die_with_parent: bool = True
    ) -> None:
        """`die_with_parent=False` lets the processes outlive this Python process (the CLI's `up`)."""
        self.workdir = Path(workdir).resolve()
        self.die_with_parent = die_with_parent
        self._binaries = binaries
        self._procs: list[subprocess.Popen[bytes]] = []
        self.state: ControlPlaneState | None = None

    # -- paths -----------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def server(self) -> str:
        if self.state is None:
            raise ControlPlaneError("control plane not started")
        return self.state.server

    # -- lifecycle -------------------------------------------------------------------------------
    @classmethod
    def attach(cls, workdir: Path | str) -> LocalControlPlane | None:
        """The control plane recorded in `workdir` if both of its processes still run."""
        plane = cls(workdir)
        state = plane._read_state()
        if state is None:
            return None
        plane.state = state
        return plane if plane.is_running() else None

    def is_running(self) -> bool:
        if self.state is None:
            return False
        marker = str(self.workdir)
        return all(_pid_alive(pid, marker) for pid in self.state.pids())

    def component_kubeconfig(self, component: str) -> Path:
        """The kubeconfig of kube-scheduler or kube-controller-manager (its client certificate)."""
        return self.workdir / "config" / f"{component}.kubeconfig"

    def start(self, timeout: float = 90.0) -> None:
        binaries = self._binaries or ensure_binaries()
        foreign = [p for p in self.workdir.glob("*") if p.name != ".lock"] if self.workdir.exists() else []
        if foreign and not (self.workdir / MARKER_FILE).exists():
            raise ControlPlaneError(f"{self.workdir} exists, is not empty and is not a control-plane dir")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / MARKER_FILE).touch()
        for sub in ("etcd", "pki", "certs", "config", "logs"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        generate_pki(self.pki)
        token = secrets.token_hex(24)
        (self.pki / "tokens.csv").write_text(f'{token},admin,admin-uid,"system:masters"\n')
        (self.pki / "tokens.csv").chmod(0o600)
        (self.workdir / "logs").mkdir()
        (self.workdir / "config").mkdir()
        try:
            etcd_port = self._start_etcd(binaries.etcd, timeout)
            port = self._start_apiserver(binaries.kube_apiserver, etcd_port, token, timeout)
            server = f"https://127.0.0.1:{port}"
            write_kubeconfig(self.kubeconfig, server, token, self.ca_file.read_bytes(), user="admin")
            for component in CLIENT_CERTS:
                write_kubeconfig(
                    self.component_kubeconfig(component), server, None, self.ca_file.read_bytes(),
                    user=CLIENT_CERTS[component][0],
                    client_cert=((self.pki / f"{component}.crt").read_bytes(),
                                 (self.pki / f"{component}.key").read_bytes()),
                )  # fmt: skip
            # Both start at once; each is waited for afterwards (their startups overlap).
            kcm_proc, kcm_port = self._spawn_controller_manager(binaries.kube_controller_manager)
            sched_proc, sched_port = self._spawn_scheduler(binaries.kube_scheduler)
            self._wait(kcm_proc, f"https://127.0.0.1:{kcm_port}/healthz", timeout,
                       "kube-controller-manager.log", verify=False)  # fmt: skip
            self._wait(sched_proc, f"https://127.0.0.1:{sched_port}/healthz", timeout,
                       "kube-scheduler.log", verify=False)  # fmt: skip
            # Healthy is not yet working: wait for the first thing a controller does (the `default`
            # ServiceAccount the ServiceAccount admission plugin needs before it admits a pod there).
            self._wait(kcm_proc, f"{server}/api/v1/namespaces/default/serviceaccounts/default", timeout,
                       "kube-controller-manager.log", token=token)  # fmt: skip
        except BaseException:
            self.stop()
            raise
        self.state = ControlPlaneState(
            etcd_pid=self._procs[0].pid,
            apiserver_pid=self._procs[1].pid,
            scheduler_pid=sched_proc.pid,
            controller_manager_pid=kcm_proc.pid,
            etcd_port=etcd_port,
            apiserver_port=port,
            scheduler_port=sched_port,
            controller_manager_port=kcm_port,
            admin_token=token,
            k8s_version=K8S_VERSION,
            etcd_version=ETCD_VERSION,
        )
        self.save_state()

    def save_state(self) -> None:
        assert self.state is not None
        (self.workdir / STATE_FILE).write_text(json.dumps(asdict(self.state), indent=2))

    def stop(self) -> None:
        """Stops every process (whole process groups) and forgets the state; keeps the directory."""
        marker = str(self.workdir)
        # Clients of the API server first, then the API server, so it never runs against a stopped etcd.
        pids = [p.pid for p in reversed(self._procs)]
        if self.state is not None:
            pids = self.state.pids()
        for pid in pids:
            _stop_group(pid, marker)
        for proc in self._procs:  # reap our own children
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs.clear()
        self.state = None
        (self.workdir / STATE_FILE).unlink(missing_ok=True)

    def restart_apiserver(self, down_seconds: float = 0.0, timeout: float = 90.0) -> float:
        """Stops kube-apiserver (SIGTERM to its group, SIGKILL after 10 s) and starts it again on the same
        port, certificates and etcd, whose data is kept: every client's kubeconfig stays valid and every
        object is still there. Waits `down_seconds` in between; returns how long the server was down
        (stop to /readyz 200)."""
        if self.state is None:
            raise ControlPlaneError("control plane not started")
        binaries = self._binaries or ensure_binaries()
        marker = str(self.workdir)
        old = self.state.apiserver_pid
        stopped = time.monotonic()
        _stop_group(old, marker)
        for proc in [p for p in self._procs if p.pid == old]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            self._procs.remove(proc)
        time.sleep(down_seconds)
        state = self.state
        self._start_apiserver(
            binaries.kube_apiserver, state.etcd_port, state.admin_token, timeout, port=state.apiserver_port
        )
        state.apiserver_pid = self._procs[-1].pid
        self.save_state()
        return time.monotonic() - stopped

    def __enter__(self) -> LocalControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals -------------------------------------------------------------------------------
    def _read_state(self) -> ControlPlaneState | None:
        try:
            return ControlPlaneState(**json.loads((self.workdir / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.workdir / "logs" / log_name, "ab") as log:
            # Own session: survives the CLI that started it and is stopped as one process group.
            proc = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.workdir,
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )  # fmt: skip
        self._procs.append(proc)
        return proc

    def _wait(
        self,
        proc: subprocess.Popen[bytes],
        url: str,
        timeout: float,
        log_name: str,
        token: str = "",
        verify: bool = True,
    ) -> None:
        """Polls `url` until it answers 200. `verify=False` for the scheduler's and controller-manager's
        self-signed serving certificates (their /healthz is open to anyone, as upstream's default)."""
        handlers: list[urllib.request.BaseHandler] = []
        if url.startswith("https"):
            ctx = ssl.create_default_context(cafile=str(self.ca_file))
            if not verify:
                ctx = ssl._create_unverified_context()
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), *handlers)  # loopback: no proxy
        if token:
            opener.addheaders = [("Authorization", f"Bearer {token}")]
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ControlPlaneError(f"{log_name} exited with {proc.returncode}:\n{self._tail(log_name)}")
            try:
                with opener.open(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ControlPlaneError(f"{url} not ready after {timeout}s ({last}):\n{self._tail(log_name)}")

    def _tail(self, log_name: str, lines: int = 30) -> str:
        try:
            text = (self.workdir / "logs" / log_name).read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        except OSError:
            return ""

    def _start_etcd(self, etcd: Path, timeout: float) -> int:
        port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
        proc = self._spawn(
            [
                str(etcd),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--listen-metrics-urls=",
                "--unsafe-no-fsync",  # test data: durability is not needed, speed is
                "--log-level=warn",
            ],
            "etcd.log",
        )
        self._wait(proc, f"{client_url}/health", timeout, "etcd.log")
        return port

    def _start_apiserver(
        self, apiserver: Path, etcd_port: int, token: str, timeout: float, port: int | None = None
    ) -> int:
        port = port or free_port()
        pki = self.pki
        proc = self._spawn(
            [
                str(apiserver),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--secure-port={port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--authorization-mode=Node,RBAC",
                f"--client-ca-file={pki / 'ca.crt'}",  # the components' client certificates
                f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--service-account-issuer=https://127.0.0.1:{port}/",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--allow-privileged=true",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--profiling=false",
            ],
            "kube-apiserver.log",
        )
        self._wait(proc, f"https://127.0.0.1:{port}/readyz", timeout, "kube-apiserver.log", token)
        return port

    def _spawn_controller_manager(self, binary: Path) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        pki, kubeconfig = self.pki, self.component_kubeconfig("kube-controller-manager")
        proc = self._spawn(
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                # Delegated authn/authz of its own /metrics etc., as kubeadm configures it.
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'certs' / 'kube-controller-manager'}",
                "--leader-elect=false",
                "--controllers=*",  # every on-by-default controller: garbage collector, namespace, ...
                # Each controller runs as its own ServiceAccount (system:controller:* roles), as in kubeadm.
                "--use-service-account-credentials=true",
                f"--root-ca-file={pki / 'ca.crt'}",  # published as kube-root-ca.crt in every namespace
                f"--service-account-private-key-file={pki / 'sa.key'}",  # the legacy token controller
                f"--cluster-signing-cert-file={pki / 'ca.crt'}",
                f"--cluster-signing-key-file={pki / 'ca.key'}",
                "--cluster-name=rljob-local",
                "--profiling=false",
            ],
            "kube-controller-manager.log",
        )
        return proc, port

    def _spawn_scheduler(self, binary: Path) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        kubeconfig = self.component_kubeconfig("kube-scheduler")
        config = self.workdir / "config" / "kube-scheduler.yaml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(kubeconfig)},
                    "leaderElection": {"leaderElect": False},
                    "profiles": [
                        {
                            "schedulerName": "default-scheduler",
                            "plugins": {
                                "multiPoint": {"disabled": [{"name": n} for n in SCHEDULER_DISABLED_PLUGINS]}
                            },
                        }
                    ],
                },
                indent=2,
            )
        )
        proc = self._spawn(
            [
                str(binary),
                f"--config={config}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'certs' / 'kube-scheduler'}",
            ],
            "kube-scheduler.log",
        )
        return proc, port


# -- CLI -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    """Serialises concurrent `up`/`down` on the same directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def binary_version(binary: Path) -> str:
    """What the binary itself reports (`--version`): `v1.34.4` for Kubernetes', `v3.6.16` for etcd."""
    args = ["version", "--client"] if binary.name == "kubectl" else ["--version"]
    try:
        out = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    for line in out.splitlines():
        words = line.replace(":", " ").split()
        if words[:1] == ["Kubernetes"] and len(words) > 1:
            return words[1]
        if words[:2] == ["Client", "Version"] and len(words) > 2:  # kubectl
            return words[2]
        if words[:2] == ["etcd", "Version"] and len(words) > 2:
            return "v" + words[2].lstrip("v")
    return out.strip() or "unknown"


def _usage(plane: LocalControlPlane) -> str:
    state = plane.state
    assert state is not None
    binaries = cached_binaries()
    rows = [
        ("etcd", binaries.etcd, state.etcd_pid, f"http://127.0.0.1:{state.etcd_port}"),
        ("kube-apiserver", binaries.kube_apiserver, state.apiserver_pid, state.server),
        ("kube-scheduler", binaries.kube_scheduler, state.scheduler_pid,
         f"https://127.0.0.1:{state.scheduler_port}/healthz"),
        ("kube-controller-manager", binaries.kube_controller_manager, state.controller_manager_pid,
         f"https://127.0.0.1:{state.controller_manager_port}/healthz"),
    ]  # fmt: skip
    lines = [f"  {name:24} {binary_version(path):9} pid {pid:<8} {url}" for name, path, pid, url in rows]
    if state.kubelet_pid:
        log = plane.workdir / "logs" / "kubelet.log"
        lines.append(f"  {'fake kubelet':24} {'':9} pid {state.kubelet_pid:<8} log {log}")
    lines += [
        f"  export KUBECONFIG={plane.kubeconfig}",
        f"  export PATH={binaries.kubectl.parent}:$PATH   # kubectl {binary_version(binaries.kubectl)}",
        "  kubectl get nodes",
    ]
    return "\n".join(lines)


def nodes_table(kubeconfig: Path) -> str:
    """`kubectl get nodes` with each node's GPU, CPU and memory capacity (the built kubectl)."""
    columns = (
        "NAME:.metadata.name,READY:.status.conditions[?(@.type=='Ready')].status,"
        "GPU:.status.capacity.nvidia\\.com/gpu,CPU:.status.capacity.cpu,MEMORY:.status.capacity.memory,"
        "KUBELET:.status.nodeInfo.kubeletVersion"
    )
    kubectl = cached_binaries().kubectl
    done = subprocess.run(
        [str(kubectl), f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", f"custom-columns={columns}"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    return (done.stdout + done.stderr).rstrip()


def _start_kubelet(plane: LocalControlPlane, nodes: int, gpus_per_node: int, timeout: float = 60) -> int:
    """Starts `python -m rljob.testing.kubelet` detached (own session, not killed with this process) and
    waits until its nodes are registered and Ready."""
    from rljob.testing.kubeaccess import KubeApi, wait_for  # late: kubeaccess imports nothing from here

    log = open(plane.workdir / "logs" / "kubelet.log", "ab")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rljob.testing.kubelet", f"--kubeconfig={plane.kubeconfig}",
         f"--nodes={nodes}", f"--gpus-per-node={gpus_per_node}", f"--scratch={plane.workdir / 'kubelet'}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        cwd=plane.workdir,
    )  # fmt: skip
    log.close()
    api = KubeApi.from_kubeconfig(plane.kubeconfig)

    def ready() -> bool:
        if proc.poll() is not None:
            tail = plane._tail("kubelet.log")
            raise ControlPlaneError(f"the fake kubelet exited with {proc.returncode}:\n{tail}")
        items = api.get("/api/v1/nodes")["items"]
        up = [n for n in items for c in n.get("status", {}).get("conditions", []) if c["type"] == "Ready"
              and c["status"] == "True"]  # fmt: skip
        return len(up) >= nodes

    try:
        wait_for(ready, timeout=timeout, interval=0.2, what=f"{nodes} Ready nodes")
    except TimeoutError as exc:
        raise ControlPlaneError(f"{exc}\n{plane._tail('kubelet.log')}") from None
    return proc.pid


def cmd_up(workdir: Path, nodes: int, gpus_per_node: int) -> int:
    with _locked(workdir):
        running = LocalControlPlane.attach(workdir)
        if running is not None:
            print(f"already running:\n{_usage(running)}")
            return 0
        stale = LocalControlPlane(workdir)
        stale.state = stale._read_state()
        if stale.state is not None:  # recorded but partly dead: clean up before starting again
            stale.stop()
        plane = LocalControlPlane(workdir, die_with_parent=False)
        started = time.monotonic()
        plane.start()
        assert plane.state is not None
        if nodes > 0:
            try:
                plane.state.kubelet_pid = _start_kubelet(plane, nodes, gpus_per_node)
            except BaseException:
                plane.stop()
                raise
            plane.save_state()
        # Detach: the processes run in their own sessions; `down` stops them via the state file.
        plane._procs.clear()
        print(f"started in {time.monotonic() - started:.1f}s:\n{_usage(plane)}")
        if nodes > 0:
            print(nodes_table(plane.kubeconfig))
        return 0


def cmd_down(workdir: Path) -> int:
    with _locked(workdir):
        plane = LocalControlPlane(workdir)
        plane.state = plane._read_state()
        was = plane.state is not None
        plane.stop()
        if (workdir / MARKER_FILE).exists():
            shutil.rmtree(workdir)
        print("stopped" if was else "not running")
        return 0


def cmd_status(workdir: Path) -> int:
    plane = LocalControlPlane.attach(workdir)
    if plane is None:
        print("not running")
        return 1
    print(f"running:\n{_usage(plane)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rljob.testing.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", default=".cluster", type=Path, help="state directory (default .cluster)")
    parser.add_argument("--nodes", type=int, default=2, help="up: simulated GPU nodes (0: no fake kubelet)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="up: nvidia.com/gpu per node")
    args = parser.parse_args(argv)
    workdir: Path = args.dir.resolve()
    try:
        if args.command == "up":
            return cmd_up(workdir, args.nodes, args.gpus_per_node)
        return {"down": cmd_down, "status": cmd_status}[args.command](workdir)
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
