"""A real, local Kubernetes control plane (etcd + kube-apiserver) for tests and the demo.

The binaries are built from Go modules by hack/build-binaries.sh into a per-version cache
(docs/control-plane.md). `LocalControlPlane` starts them on loopback with free ports, RBAC on,
a ServiceAccount issuer and signing key, and an admin token (group system:masters), then writes a
kubeconfig. Processes run in their own sessions so they can outlive the CLI (`up`) and be stopped
as whole process groups (`down`).

CLI:  python -m rljob.testing.cluster up|down|status [--dir .cluster]
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


def ensure_binaries(build: bool = True) -> Binaries:
    """Returns the cached binaries, building missing ones with hack/build-binaries.sh if allowed."""
    found = Binaries(
        etcd=binary_path("etcd", ETCD_VERSION),
        kube_apiserver=binary_path("kube-apiserver", K8S_VERSION),
        helm=binary_path("helm", HELM_VERSION),
    )
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


def generate_pki(pki: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1/localhost and the ServiceAccount signing key pair."""
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
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki / "sa.key"))
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    for key in pki.glob("*.key"):
        key.chmod(0o600)


@dataclass
class ControlPlaneState:
    etcd_pid: int
    apiserver_pid: int
    etcd_port: int
    apiserver_port: int
    admin_token: str
    k8s_version: str
    etcd_version: str

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"


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


class LocalControlPlane:
    """etcd + kube-apiserver under `workdir`. Use as a context manager, or start()/stop()."""

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
        return _pid_alive(self.state.etcd_pid, marker) and _pid_alive(self.state.apiserver_pid, marker)

    def start(self, timeout: float = 90.0) -> None:
        binaries = self._binaries or ensure_binaries()
        foreign = [p for p in self.workdir.glob("*") if p.name != ".lock"] if self.workdir.exists() else []
        if foreign and not (self.workdir / MARKER_FILE).exists():
            raise ControlPlaneError(f"{self.workdir} exists, is not empty and is not a control-plane dir")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / MARKER_FILE).touch()
        for sub in ("etcd", "pki", "certs", "logs"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        generate_pki(self.pki)
        token = secrets.token_hex(24)
        (self.pki / "tokens.csv").write_text(f'{token},admin,admin-uid,"system:masters"\n')
        (self.pki / "tokens.csv").chmod(0o600)
        (self.workdir / "logs").mkdir()
        try:
            etcd_port = self._start_etcd(binaries.etcd, timeout)
            port = self._start_apiserver(binaries.kube_apiserver, etcd_port, token, timeout)
        except BaseException:
            self.stop()
            raise
        self.state = ControlPlaneState(
            etcd_pid=self._procs[0].pid,
            apiserver_pid=self._procs[1].pid,
            etcd_port=etcd_port,
            apiserver_port=port,
            admin_token=token,
            k8s_version=K8S_VERSION,
            etcd_version=ETCD_VERSION,
        )
        write_kubeconfig(self.kubeconfig, self.server, token, self.ca_file.read_bytes(), user="admin")
        (self.workdir / STATE_FILE).write_text(json.dumps(asdict(self.state), indent=2))

    def stop(self) -> None:
        """Stops both processes (whole process groups) and forgets the state; keeps the directory."""
        marker = str(self.workdir)
        # The API server first, so it never runs against a stopped etcd.
        pids = [p.pid for p in reversed(self._procs)]
        if self.state is not None:
            pids = [self.state.apiserver_pid, self.state.etcd_pid]
        for pid in pids:
            _stop_group(pid, marker)
        for proc in self._procs:  # reap our own children
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._procs.clear()
        self.state = None
        (self.workdir / STATE_FILE).unlink(missing_ok=True)

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
        self, proc: subprocess.Popen[bytes], url: str, timeout: float, log_name: str, token: str = ""
    ) -> None:
        handlers: list[urllib.request.BaseHandler] = []
        if url.startswith("https"):
            ctx = ssl.create_default_context(cafile=str(self.ca_file))
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

    def _start_apiserver(self, apiserver: Path, etcd_port: int, token: str, timeout: float) -> int:
        port = free_port()
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
                "--authorization-mode=RBAC",
                f"--service-account-issuer=https://127.0.0.1:{port}/",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--allow-privileged=true",
                # No controller-manager creates default ServiceAccounts, so the plugin would reject pods.
                "--disable-admission-plugins=ServiceAccount",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--profiling=false",
            ],
            "kube-apiserver.log",
        )
        self._wait(proc, f"https://127.0.0.1:{port}/readyz", timeout, "kube-apiserver.log", token)
        return port


# -- CLI -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    """Serialises concurrent `up`/`down` on the same directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _usage(plane: LocalControlPlane) -> str:
    state = plane.state
    assert state is not None
    return (
        f"kube-apiserver {state.k8s_version} at {state.server} (etcd {state.etcd_version}, "
        f"pids {state.apiserver_pid}/{state.etcd_pid})\n"
        f"  export KUBECONFIG={plane.kubeconfig}\n"
        f"  kubectl get --raw /version"
    )


def cmd_up(workdir: Path) -> int:
    with _locked(workdir):
        running = LocalControlPlane.attach(workdir)
        if running is not None:
            print(f"already running: {_usage(running)}")
            return 0
        stale = LocalControlPlane(workdir)
        stale.state = stale._read_state()
        if stale.state is not None:  # recorded but partly dead: clean up before starting again
            stale.stop()
        plane = LocalControlPlane(workdir, die_with_parent=False)
        started = time.monotonic()
        plane.start()
        # Detach: the processes run in their own sessions; `down` stops them via the state file.
        plane._procs.clear()
        print(f"started in {time.monotonic() - started:.1f}s: {_usage(plane)}")
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
    print(f"running: {_usage(plane)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rljob.testing.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", default=".cluster", type=Path, help="state directory (default .cluster)")
    args = parser.parse_args(argv)
    workdir: Path = args.dir.resolve()
    try:
        return {"up": cmd_up, "down": cmd_down, "status": cmd_status}[args.command](workdir)
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
