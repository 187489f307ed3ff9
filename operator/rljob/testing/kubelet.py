"""A fake kubelet: simulated GPU nodes whose pods run as local processes on loopback pod IPs.

`Kubelet` registers real Node objects (by default 2 nodes with 8 `nvidia.com/gpu` each, plus CPU,
memory and a pod count), keeps them alive like a kubelet (NodeReady condition, a Lease in
kube-node-lease renewed every 10 s) and runs the pods the scheduler bound to them: it gives each pod a
loopback IP (127.0.0.2, ...), materialises its volumes (Secret, ConfigMap, emptyDir) in a per-pod
scratch dir, resolves the containers' env and starts one local process per container, chosen by a
*mapping*:

    Mapping = Callable[[ContainerContext], Launch | Sequence[str] | None]

(None falls back to `default_mapping`, which runs the container's command + args as given with
mount paths rewritten to the scratch dir). It reports pods/status like a kubelet does (phase,
conditions, podIP, containerStatuses), applies restartPolicy with a short backoff, runs init containers
in order and native sidecars (init containers with `restartPolicy: Always`: started before the
containers, restarted whenever they exit, restartCount++, in initContainerStatuses, their readiness
counting for the pod's; one with a startupProbe holds back the next containers until it passes), runs
startupProbes and readinessProbes (httpGet, tcpSocket, exec) against the pod IP, keeps
`emptyDir: {medium: Memory}` volumes on tmpfs (/dev/shm) as a kubelet does, and on deletion stops the
processes (SIGTERM, SIGKILL after a bounded grace period) and finalizes the pod (grace 0), in any
namespace, so the namespace controller and the garbage collector can finish. It never binds a pod
itself: placement is the scheduler's.

CLI:  python -m rljob.testing.kubelet --kubeconfig KUBECONFIG [--nodes 2 --gpus-per-node 8] [-n NS ...]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import ipaddress
import logging
import os
import platform
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Mapping as MappingOf
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Union
from urllib.parse import urlparse

import requests

from rljob.testing.cluster import K8S_VERSION, die_with_parent
from rljob.testing.kubeaccess import ApiError, JsonObj, KubeApi, WatchStream, pod_path

log = logging.getLogger("rljob.testing.kubelet")

NODE_PREFIX = "rljob-gpu"  # nodes are <prefix>-0, <prefix>-1, ...
HEARTBEAT_WORKERS = 16  # nodes whose Lease and status the kubelet renews at once
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
NODE_LEASE_NAMESPACE = "kube-node-lease"
HOST_IP = "127.0.0.1"
# Host variables a process inherits (a real container inherits none; a local process needs these).
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "USER")


# -- mapping API ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContainerContext:
    """Everything a mapping needs to turn one container of a pod into a local process."""

    pod: JsonObj
    container: JsonObj
    pod_ip: str
    scratch: Path  # per-pod scratch dir: volumes/, logs/
    mounts: dict[str, Path]  # the container's mountPath -> local path in scratch
    env: dict[str, str]  # the container's env: resolved, $(VAR)-expanded, mount paths remapped
    api: KubeApi  # the kubelet's API access (e.g. to read more objects)

    @property
    def name(self) -> str:
        return str(self.container["name"])

    @property
    def image(self) -> str:
        return str(self.container.get("image", ""))

    def remap(self, text: str) -> str:
        return remap_paths(text, self.mounts)

    def argv(self) -> list[str]:
        """command + args with $(VAR) expanded (as the kubelet does) and mount paths remapped."""
        raw = [*self.container.get("command", []), *self.container.get("args", [])]
        return [self.remap(expand_vars(str(a), self.env)) for a in raw]


@dataclass(frozen=True)
class Launch:
    """How to start a container: argv, extra env (overrides the container's) and cwd (default scratch)."""

    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None


Mapping = Callable[[ContainerContext], Union[Launch, Sequence[str], None]]  # noqa: UP007 (runtime alias)


def default_mapping(ctx: ContainerContext) -> Launch:
    argv = ctx.argv()
    if not argv:
        raise ValueError(f"container {ctx.name!r} has no command; the image entrypoint is unknown here")
    return Launch(argv)


def table_mapping(
    by_name: dict[str, Mapping] | None = None,
    by_image: dict[str, Mapping] | None = None,
    fallback: Mapping = default_mapping,
) -> Mapping:
    """A mapping that dispatches on container name first, then on image (with or without tag)."""

    def mapping(ctx: ContainerContext) -> Launch | Sequence[str] | None:
        image = ctx.image
        untagged = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
        for chosen in (
            (by_name or {}).get(ctx.name),
            (by_image or {}).get(image),
            (by_image or {}).get(untagged),
        ):
            if chosen is not None:
                return chosen(ctx)
        return fallback(ctx)

    return mapping


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, `$$` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def remap_paths(text: str, mounts: dict[str, Path]) -> str:
    """Rewrites absolute mount paths (at path boundaries) in `text` to their scratch locations."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        target = mount_path.rstrip("/") or "/"
        pattern = r"(?<![\w./-])" + re.escape(target) + r"(?=/|$|[^\w.-])"
        local = str(mounts[mount_path])
        text = re.sub(pattern, lambda _m, local=local: local, text)  # type: ignore[misc]
    return text


# -- pod IPs -------------------------------------------------------------------------------------
class IpAllocator:
    """Hands out loopback IPs 127.0.0.2, 127.0.0.3, ... round-robin, as CNI's host-local IPAM does (the
    next free one after the last handed out, plugins/ipam/host-local/backend/allocator/allocator.go
    `GetIter`@containernetworking/plugins 2a46e67): a freed IP comes back only after the whole range, so
    no new pod takes the IP a deleted pod's in-process agent or trainer (shared_pods.py) may still use."""

    def __init__(self, first: str = "127.0.0.2", last: str = "127.255.255.254") -> None:
        self._first = int(ipaddress.IPv4Address(first))
        self._last = int(ipaddress.IPv4Address(last))
        self._next = self._first
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def acquire(self, wanted: str | None = None) -> str:
        with self._lock:
            if wanted:
                with contextlib.suppress(ValueError):
                    addr = ipaddress.IPv4Address(wanted)
                    if self._first <= int(addr) <= self._last and int(addr) not in self._used:
                        self._used.add(int(addr))
                        return str(addr)
            n = self._next
            for _ in range(self._last - self._first + 1):
                if n not in self._used and n & 0xFF not in (0, 255):
                    self._used.add(n)
                    self._next = n + 1 if n < self._last else self._first
                    return str(ipaddress.IPv4Address(n))
                n = n + 1 if n < self._last else self._first
            raise RuntimeError("loopback pod IPs exhausted")

    def release(self, ip: str) -> None:
        with self._lock:
            self._used.discard(int(ipaddress.IPv4Address(ip)))


# Shared by all kubelets of a process so that they never collide; the second octet comes from the pid so
# that two processes (a test run and `make demo`) on one machine don't hand out the same addresses.
SHARED_IPS = IpAllocator(f"127.{os.getpid() % 200 + 20}.0.2")


# -- volumes and env -----------------------------------------------------------------------------
class NotReady(Exception):
    """A referenced Secret/ConfigMap (key) is missing; the kubelet retries, as a real one does."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_source(api: KubeApi, ns: str, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
    """The decoded data of a Secret or ConfigMap; None when it is absent and optional."""
    path = f"/api/v1/namespaces/{ns}/{'secrets' if kind == 'secret' else 'configmaps'}/{name}"
    try:
        obj = api.get(path)
    except ApiError as exc:
        if exc.status == 404 and optional:
            return None
        if exc.status == 404:
            raise NotReady(f"{kind} {ns}/{name} not found") from exc
        raise
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def materialise_volumes(
    api: KubeApi, pod: JsonObj, scratch: Path, memory_dir: Path | None = None
) -> dict[str, Path]:
    """Writes the pod's volumes under scratch/volumes/<name> (a memory-backed emptyDir under `memory_dir`,
    a tmpfs, when given); returns volume name -> local dir."""
    ns = pod["metadata"]["namespace"]
    out: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes") or []:
        claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
        in_memory = memory_dir is not None and (vol.get("emptyDir") or {}).get("medium") == "Memory"
        # A claim outlives its pods: one directory per claim, shared by every pod of the namespace.
        local = scratch.parent / "claims" / claim if claim else scratch / "volumes" / vol["name"]
        if in_memory and memory_dir is not None:
            local = memory_dir / vol["name"]
        local.mkdir(parents=True, exist_ok=True)
        out[vol["name"]] = local
        for kind, name_key in (("secret", "secretName"), ("configMap", "name")):
            src = vol.get(kind)
            if src is None:
                continue
            data = _read_source(api, ns, kind.lower(), src[name_key], bool(src.get("optional")))
            items = src.get("items") or [{"key": k, "path": k} for k in (data or {})]
            for item in items:
                if data is None or item["key"] not in data:
                    if data is not None and not src.get("optional"):
                        raise NotReady(f"{kind} {src[name_key]} has no key {item['key']}")
                    continue
                target = local / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[item["key"]])
                target.chmod(item.get("mode", src.get("defaultMode", 0o644)))
        # emptyDir, hostPath (kept off the host on purpose) and others: an empty local dir.
    return out


def container_mounts(container: JsonObj, volumes: dict[str, Path]) -> dict[str, Path]:
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts") or []:
        local = volumes.get(m["name"])
        if local is not None:
            mounts[m["mountPath"]] = local / m["subPath"] if m.get("subPath") else local
    return mounts


def _field_value(pod: JsonObj, pod_ip: str, field_path: str) -> str:
    meta = pod["metadata"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", field_path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    values = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": HOST_IP,
        "status.hostIPs": HOST_IP,
    }
    return str(values.get(field_path, ""))


def resolve_env(api: KubeApi, pod: JsonObj, container: JsonObj, pod_ip: str) -> dict[str, str]:
    """The container's env as the kubelet computes it: envFrom, then env (value / valueFrom)."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        for kind in ("secret", "configMap"):
            ref = src.get(f"{kind}Ref")
            if ref is not None:
                data = _read_source(api, ns, kind.lower(), ref["name"], bool(ref.get("optional"))) or {}
                env.update({src.get("prefix", "") + k: v.decode() for k, v in data.items()})
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = expand_vars(str(var.get("value", "")), env)
        elif "fieldRef" in source:
            env[name] = _field_value(pod, pod_ip, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind = "secret" if "secretKeyRef" in source else "configMap"
            ref = source[f"{kind}KeyRef"]
            found = _read_source(api, ns, kind.lower(), ref["name"], bool(ref.get("optional")))
            if found is not None and ref["key"] in found:
                env[name] = found[ref["key"]].decode()
            elif not ref.get("optional"):
                raise NotReady(f"{kind} {ref['name']} has no key {ref['key']}")
        elif "resourceFieldRef" in source:
            res = source["resourceFieldRef"]["resource"]  # e.g. limits.cpu; divisor ignored
            group, _, key = res.partition(".")
            env[name] = str(((container.get("resources") or {}).get(group) or {}).get(key, "0"))
    return env


# -- processes -----------------------------------------------------------------------------------
def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each process group, SIGKILL after `grace` seconds, and reap."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            _kill_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        _kill_group(p.pid, signal.SIGKILL)  # also stragglers the leader left in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


@dataclass
class ContainerRun:
    """Runtime state of one container of a pod."""

    spec: JsonObj
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    started_at: str = ""
    restart_count: int = 0
    terminated: JsonObj | None = None  # the latest exit
    last_terminated: JsonObj | None = None  # the exit before a restart
    final: bool = False  # exited and will not be restarted
    next_start: float = 0.0
    ready: bool = False
    probe_failures: int = 0
    next_probe: float = 0.0
    start_error: str = ""
    ran: bool = False  # a process was started at least once
    started: bool = False  # the running process passed its startupProbe (at once without one)
    started_once: bool = False  # some process of it did: a sidecar then no longer holds the pod back

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def sidecar(self) -> bool:
        """A native sidecar: an init container with restartPolicy Always (KEP-753)."""
        return self.init and self.spec.get("restartPolicy") == "Always"


def _http_probe(spec: JsonObj, host: str, port: int, timeout: float) -> bool:
    conn_cls = http.client.HTTPSConnection if spec.get("scheme") == "HTTPS" else http.client.HTTPConnection
    kwargs: dict[str, Any] = {"timeout": timeout}
    if conn_cls is http.client.HTTPSConnection:
        kwargs["context"] = ssl._create_unverified_context()  # probes never verify, as the kubelet's
    conn = conn_cls(host, port, **kwargs)
    try:
        headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
        conn.request("GET", spec.get("path") or "/", headers=headers)
        return 200 <= conn.getresponse().status < 400
    finally:
        conn.close()


def _probe_port(container: JsonObj, port: Any) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"unknown named port {port!r}")


# -- pod names -----------------------------------------------------------------------------------
CLUSTER_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class PodName:
    """A pod's stable DNS name: hostname `h` under the headless Service `s` of namespace `ns`
    (`h.s.ns.svc.cluster.local`, and the shorter forms a pod's DNS search path resolves)."""

    namespace: str
    hostname: str
    subdomain: str
    ip: str

    def names(self) -> list[str]:
        fqdn = f"{self.hostname}.{self.subdomain}.{self.namespace}.svc"
        return [f"{fqdn}.{CLUSTER_DOMAIN}", fqdn, f"{self.hostname}.{self.subdomain}.{self.namespace}",
                f"{self.hostname}.{self.subdomain}"]  # fmt: skip


def hosts_file_text(own: JsonObj, own_ip: str, gang: Iterable[PodName]) -> str:
    """The pod's /etc/hosts as a kubelet writes it (pkg/kubelet/kubelet_pods.go@v1.34.4,
    managedHostsFileContent: localhost, then the pod's IP with its FQDN and hostname), plus every stable
    name of its namespace, which cluster DNS would answer here (the gang's headless Service)."""
    spec = own.get("spec") or {}
    hostname = spec.get("hostname") or own["metadata"]["name"]
    lines = [
        "# Kubernetes-managed hosts file (the rljob fake kubelet).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    if spec.get("subdomain"):
        own_name = PodName(own["metadata"]["namespace"], hostname, spec["subdomain"], own_ip)
        lines.append(f"{own_ip}\t{own_name.names()[0]}\t{hostname}")
    else:
        lines.append(f"{own_ip}\t{hostname}")
    lines.append("# the namespace's pod names (cluster DNS)")
    for name in sorted(gang, key=lambda n: (n.subdomain, n.hostname)):
        lines.append(f"{name.ip}\t{' '.join(name.names())}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, text: str) -> None:
    """Rewrites the file's own inode (a bind mount pins the inode: a rename would not be seen). One
    write, then the truncation: a reader sees the old or the new lines, at worst with a stale tail."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


HOSTS_WRAPPER = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'


SETPRIV = shutil.which("setpriv")  # util-linux


def killed_with_parent(
    argv: list[str], env: dict[str, str], cwd: Path | str
) -> tuple[list[str], Callable[[], None] | None]:
    """A container's command line and preexec_fn such that the kernel kills it when the runner thread
    that started it dies. Through `setpriv --pdeathsig KILL` when it can: a preexec_fn makes Python fork
    (no vfork) and run Python in the child, and a fork of this process (hundreds of threads, hundreds
    of MB at 512 pods) costs milliseconds of kernel time each. setpriv sets the signal as it starts, a
    moment after Popen returned: a runner thread lives on after starting a container. A command that
    does not resolve keeps the preexec_fn, so that Popen fails for it as before (StartError)."""
    exe = argv[0]
    if os.sep in exe:
        found = os.access(os.path.join(cwd, exe), os.X_OK)
    else:
        found = shutil.which(exe, path=os.pathsep.join(os.get_exec_path(env))) is not None
    if SETPRIV is None or not found:
        return argv, die_with_parent
    return [SETPRIV, "--pdeathsig", "KILL", "--", *argv], None


def can_mount_pod_hosts() -> bool:
    """A private mount (and UTS) namespace per container needs root and util-linux's unshare."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None and Path("/etc/hosts").is_file()


# -- pod runner ----------------------------------------------------------------------------------
class PodRunner:
    """Runs one pod from start to deletion in its own thread."""

    def __init__(self, kubelet: Kubelet, pod: JsonObj) -> None:
        meta = pod["metadata"]
        self.thread = threading.Thread(
            target=self.run, name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True
        )
        self.kubelet = kubelet
        self.pod = pod
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.node_name: str = pod["spec"].get("nodeName", "")
        self.scratch: Path = kubelet.scratch_root / self.namespace / f"{self.pod_name}-{self.uid[:8]}"
        self.pod_ip = ""
        self.start_time = ""
        self.containers: list[ContainerRun] = []
        self._stop = threading.Event()
        self._delete = False  # finalize the pod in the API after stopping
        self._gone = False  # the pod no longer exists in the API
        self._grace = kubelet.max_grace
        self._last_status: JsonObj | None = None
        self._transitions: dict[str, tuple[str, str]] = {}
        self.volumes: dict[str, Path] = {}
        self.envs: dict[str, dict[str, str]] = {}
        root = kubelet.memory_root
        self.memory_dir = root / self.namespace / f"{self.pod_name}-{self.uid[:8]}" if root else None

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    # called from the watch threads
    def request_delete(self, grace_seconds: float | None) -> None:
        self._grace = min(self.kubelet.max_grace, grace_seconds if grace_seconds is not None else 30.0)
        self._delete = True
        self._stop.set()

    def request_stop(self, gone: bool, grace: float) -> None:
        self._gone = self._gone or gone
        self._grace = min(self._grace, grace)
        self._stop.set()

    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        return {c.name: c.proc for c in self.containers if c.proc is not None}

    def log_path(self, container: str) -> Path:
        return self.scratch / "logs" / f"{container}.log"

    # the thread
    def run(self) -> None:
        try:
            if self._prepare():
                while not self._stop.is_set():
                    self._tick()
                    self._stop.wait(self.kubelet.tick)
        except Exception:
            log.exception("pod %s/%s failed in the fake kubelet", self.namespace, self.pod_name)
        finally:
            stop_processes([c.proc for c in self.containers if c.proc is not None], self._grace)
            if self.memory_dir is not None:
                shutil.rmtree(self.memory_dir, ignore_errors=True)  # tmpfs: the pod's memory goes with it
            if self.pod_ip:
                self.kubelet.ips.release(self.pod_ip)
            self.kubelet.forget_name(self.uid)
            if self._delete and not self._gone:
                self.kubelet.force_delete(self.namespace, self.pod_name, self.uid)
            self.kubelet.forget(self.uid, self)

    def _prepare(self) -> bool:
        """Takes an IP and waits for the pod's volumes and env sources to exist."""
        self.pod_ip = self.kubelet.ips.acquire((self.pod.get("status") or {}).get("podIP"))
        self.hosts_file = self.scratch / "etc-hosts"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.kubelet.note_name(self.pod, self.pod_ip)  # before its status says so: its own processes need it
        self.start_time = _now()
        spec = self.pod["spec"]
        self.containers = [ContainerRun(c, init=True) for c in spec.get("initContainers") or []]
        self.containers += [ContainerRun(c) for c in spec["containers"]]
        (self.scratch / "logs").mkdir(parents=True, exist_ok=True)
        while not self._stop.is_set():
            try:
                self.volumes = materialise_volumes(self.kubelet.api, self.pod, self.scratch, self.memory_dir)
                self.envs = {
                    c.name: resolve_env(self.kubelet.api, self.pod, c.spec, self.pod_ip)
                    for c in self.containers
                }
                return True
            except NotReady as exc:
                self._report(waiting_reason="CreateContainerConfigError", message=str(exc))
                self._stop.wait(1.0)
        return False

    def _tick(self) -> None:
        now = time.monotonic()
        pending_init = next((c for c in self.containers if c.init and not self._init_done(c)), None)
        if self._mains_done():
            self._stop_sidecars()
        for c in self.containers:
            # Init containers run one at a time, in order; a sidecar, once started, keeps being run beside
            # the next ones and the containers.
            if c.init and c is not pending_init and not (c.sidecar and c.ran):
                continue
            if pending_init is not None and not c.init:
                break
            if c.proc is None:
                if not c.final and now >= c.next_start:
                    self._start(c)
                continue
            code = c.proc.poll()
            if code is None:
                self._probe(c, now)
                continue
            self._exited(c, code, now)
        self._report()

    def _init_done(self, c: ContainerRun) -> bool:
        # Started (its startupProbe passed): the next init container, or the containers, may start
        # (kubernetes.io/docs/concepts/workloads/pods/sidecar-containers, "Sidecar containers and Pod
        # lifecycle"). A sidecar restarted later does not hold back what already runs.
        if c.sidecar:
            return c.started_once
        return c.terminated is not None and c.terminated["exitCode"] == 0 and c.proc is None

    def _mains_done(self) -> bool:
        mains = [c for c in self.containers if not c.init]
        return bool(mains) and all(c.final for c in mains)

    def _stop_sidecars(self) -> None:
        """Every container has ended: the sidecars are stopped too (they never restart after that)."""
        running = [c for c in self.containers if c.sidecar and c.proc is not None]
        stop_processes([c.proc for c in running if c.proc is not None], self._grace)
        for c in running:
            if c.proc is not None:
                self._exited(c, c.proc.returncode if c.proc.returncode is not None else 137, time.monotonic())
        for c in self.containers:
            if c.sidecar:
                c.final = True

    def _context(self, c: ContainerRun) -> ContainerContext:
        mounts = container_mounts(c.spec, self.volumes)
        env = {k: remap_paths(v, mounts) for k, v in self.envs[c.name].items()}
        return ContainerContext(self.pod, c.spec, self.pod_ip, self.scratch, mounts, env, self.kubelet.api)

    def _start(self, c: ContainerRun) -> None:
        if c.terminated is not None:  # a restart
            c.last_terminated, c.terminated = c.terminated, None
            c.restart_count += 1
        ctx = self._context(c)
        try:
            launch = self.kubelet.mapping(ctx) or default_mapping(ctx)
            if not isinstance(launch, Launch):
                launch = Launch(list(launch))
            env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
            env.update(self.kubelet.service_env)
            env.update({"HOSTNAME": self.pod_name, **ctx.env, **launch.env})
            cwd = launch.cwd or self.scratch
            argv = self.kubelet.in_pod(self, [str(a) for a in launch.argv])
            argv, preexec = killed_with_parent(argv, env, cwd)
            with open(self.log_path(c.name), "ab") as out:
                c.proc = subprocess.Popen(
                    argv, cwd=cwd, env=env,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,  # one process group per container: stopped as a whole
                    preexec_fn=preexec,
                )  # fmt: skip
            c.started_at, c.ready, c.probe_failures, c.next_probe, c.start_error = _now(), False, 0, 0.0, ""
            c.ran, c.started = True, False
        except Exception as exc:  # a failed start counts as an exit, as a runtime's StartError does
            c.start_error = f"{type(exc).__name__}: {exc}"
            log.warning("cannot start %s/%s[%s]: %s", self.namespace, self.pod_name, c.name, c.start_error)
            c.started_at = _now()
            self._exited(c, 128, time.monotonic())

    def _exited(self, c: ContainerRun, code: int, now: float) -> None:
        if c.proc is not None:
            _kill_group(c.proc.pid, signal.SIGKILL)  # stragglers of the exited leader
            c.proc.wait()
        c.proc, c.ready, c.started = None, False, False
        reason = "StartError" if c.start_error else ("Completed" if code == 0 else "Error")
        c.terminated = {
            "exitCode": code, "reason": reason, "startedAt": c.started_at or _now(), "finishedAt": _now(),
            "containerID": f"rljob-sim://{self.uid[:8]}-{c.name}",
        }  # fmt: skip
        if c.start_error:
            c.terminated["message"] = c.start_error
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if c.sidecar:  # whatever the pod's policy, until the containers have ended
            restart = not self._mains_done()
        elif c.init:  # init containers run to completion; Always counts as OnFailure for them
            restart = code != 0 and policy != "Never"
        else:
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if restart:
            base, cap = self.kubelet.backoff
            c.next_start = now + min(cap, base * 2 ** min(c.restart_count, 10))
        else:
            c.final = True

    def _probe(self, c: ContainerRun, now: float) -> None:
        if c.init and not c.sidecar:
            return
        if not c.started:
            self._startup_probe(c, now)
            if not c.started:
                return  # readiness is probed only once the startup probe passed
        probe = c.spec.get("readinessProbe")
        if not probe:
            c.ready = True
            return
        if now < c.next_probe:
            return
        c.next_probe = now + min(float(probe.get("periodSeconds", 10)), self.kubelet.probe_period)
        ok = self._run_probe(c, probe)
        if ok:
            c.ready, c.probe_failures = True, 0
        else:
            c.probe_failures += 1
            if not c.ready or c.probe_failures >= int(probe.get("failureThreshold", 3)):
                c.ready = False

    def _startup_probe(self, c: ContainerRun, now: float) -> None:
        """A startupProbe: until it passes the container is not started (a sidecar holds back the next
        containers); failureThreshold failures in a row kill it, to be restarted by its policy."""
        probe = c.spec.get("startupProbe")
        if not probe:
            c.started = c.started_once = True
            return
        if now < c.next_probe:
            return
        c.next_probe = now + min(float(probe.get("periodSeconds", 10)), self.kubelet.probe_period)
        if self._run_probe(c, probe):
            c.started = c.started_once = True
            c.probe_failures = 0
            return
        c.probe_failures += 1
        if c.probe_failures >= int(probe.get("failureThreshold", 3)) and c.proc is not None:
            where = f"{self.namespace}/{self.pod_name}[{c.name}]"
            log.info("%s: startup probe failed %d times: killed", where, c.probe_failures)
            _kill_group(c.proc.pid, signal.SIGKILL)

    def _run_probe(self, c: ContainerRun, probe: JsonObj) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                spec = probe["httpGet"]
                # Probes always go to the pod IP: the simulator never sends traffic off loopback.
                return _http_probe(spec, self.pod_ip, _probe_port(c.spec, spec["port"]), timeout)
            if "tcpSocket" in probe:
                port = _probe_port(c.spec, probe["tcpSocket"]["port"])
                with socket.create_connection((self.pod_ip, port), timeout=timeout):
                    return True
            if "exec" in probe:
                ctx = self._context(c)
                argv = [ctx.remap(expand_vars(a, ctx.env)) for a in probe["exec"]["command"]]
                env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ} | ctx.env
                run = subprocess.run(argv, cwd=self.scratch, env=env, capture_output=True, timeout=timeout)
                return run.returncode == 0
        except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException):
            return False
        return True  # grpc probes are not simulated

    # -- status ----------------------------------------------------------------------------------
    def _container_status(self, c: ContainerRun, waiting_reason: str, message: str) -> JsonObj:
        status: JsonObj = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "containerID": f"rljob-sim://{self.uid[:8]}-{c.name}",
            "restartCount": c.restart_count,
            "ready": c.ready,
            "started": c.proc is not None and c.started,
        }
        if c.proc is not None:
            status["state"] = {"running": {"startedAt": c.started_at}}
        elif c.sidecar and c.terminated is not None and not c.final:
            # Exited, to be started again after its backoff, as a kubelet reports it.
            status["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
            status["lastState"] = {"terminated": c.terminated}
            return status
        elif c.terminated is not None:
            status["state"] = {"terminated": c.terminated}
        else:
            waiting: JsonObj = {"reason": waiting_reason or "ContainerCreating"}
            if message:
                waiting["message"] = message
            status["state"] = {"waiting": waiting}
        status["lastState"] = {"terminated": c.last_terminated} if c.last_terminated else {}
        return status

    def _condition(self, kind: str, ok: bool) -> JsonObj:
        value = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != value:
            self._transitions[kind] = (value, _now())
        return {"type": kind, "status": value, "lastTransitionTime": self._transitions[kind][1]}

    def _phase(self) -> str:
        inits = [c for c in self.containers if c.init]
        mains = [c for c in self.containers if not c.init]
        if any(c.final and c.terminated and c.terminated["exitCode"] != 0 for c in inits if not c.sidecar):
            return "Failed"  # a sidecar's exit code never decides the phase
        if not all(self._init_done(c) for c in inits) or not any(c.started_at for c in mains):
            return "Pending"
        if all(c.final for c in mains):
            return (
                "Succeeded"
                if all(c.terminated and c.terminated["exitCode"] == 0 for c in mains)
                else "Failed"
            )
        return "Running"

    def _report(self, waiting_reason: str = "", message: str = "") -> None:
        phase = self._phase()
        inits = [c for c in self.containers if c.init]
        mains = [c for c in self.containers if not c.init]
        sidecars = [c for c in inits if c.sidecar]
        ready = phase == "Running" and all(c.ready for c in [*mains, *sidecars])
        status: JsonObj = {
            "phase": phase,
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("Initialized", all(self._init_done(c) for c in inits)),
                self._condition("ContainersReady", ready),
                self._condition("Ready", ready),
            ],
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.start_time,
            "containerStatuses": [self._container_status(c, waiting_reason, message) for c in mains],
        }
        if inits:
            status["initContainerStatuses"] = [
                self._container_status(c, waiting_reason, message) for c in inits
            ]
        if status == self._last_status:
            return
        try:
            self.kubelet.api.merge_patch(
                pod_path(self.namespace, self.pod_name, "status"), {"status": status}
            )
            self._last_status = status
        except ApiError as exc:
            if exc.status == 404:
                self.request_stop(gone=True, grace=self.kubelet.max_grace)
            else:
                log.warning("status of %s/%s: %s", self.namespace, self.pod_name, exc)
        except requests.RequestException as exc:
            log.warning("status of %s/%s: %s", self.namespace, self.pod_name, exc)


# -- nodes ---------------------------------------------------------------------------------------
def _micro_now() -> str:
    """A MicroTime (Lease renewTime)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class NodeShape:
    """What one simulated node offers the scheduler: its capacity (= allocatable) and labels."""

    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110  # the kubelet's default --max-pods
    ephemeral_storage: str = "1Ti"
    labels: MappingOf[str, str] = field(default_factory=dict)

    def capacity(self) -> dict[str, str]:
        resources = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "ephemeral-storage": self.ephemeral_storage,
        }
        if self.gpus:
            resources[GPU_RESOURCE] = str(self.gpus)
        return resources


@dataclass
class SimNode:
    """A registered node: its shape and the uid its Lease is owned by."""

    name: str
    shape: NodeShape
    uid: str = ""
    last_status: float = 0.0


# -- the kubelet ---------------------------------------------------------------------------------
class Kubelet:
    """Registers `nodes` simulated GPU nodes (`<node_prefix>-<i>`, each of `shape`) and runs the pods the
    scheduler binds to them, if they are in `namespaces` (every namespace when empty). Pods of other
    namespaces bound to its nodes are not run, but their deletion is finalized as a kubelet would."""

    def __init__(
        self,
        kubeconfig: Path | str,
        namespaces: Sequence[str] = (),
        mapping: Mapping = default_mapping,
        nodes: int = 2,
        shape: NodeShape | None = None,
        node_prefix: str = NODE_PREFIX,
        scratch_root: Path | str | None = None,
        ips: IpAllocator = SHARED_IPS,
        max_grace: float = 10.0,
        backoff: tuple[float, float] = (0.2, 5.0),
        probe_period: float = 0.5,
        tick: float = 0.1,
        watch_read_timeout: float = 2.0,
        lease_seconds: int = 40,
        heartbeat: float = 10.0,
        status_every: float = 60.0,
        pod_hosts: bool | None = None,
    ) -> None:
        """`lease_seconds`, `heartbeat` and `status_every` are a kubelet's defaults: a 40 s Lease renewed
        every 10 s (pkg/kubelet/apis/config/v1beta1/defaults.go@v1.34.4: nodeLeaseDurationSeconds, and a
        quarter of it for renewal), node status re-posted at least every minute (upstream: 5 min)."""
        self.api = KubeApi.from_kubeconfig(kubeconfig)
        self.namespaces = list(namespaces)
        self.mapping = mapping
        self.shape = shape or NodeShape()
        self.node_prefix = node_prefix
        self._nodes: dict[str, SimNode] = {
            f"{node_prefix}-{i}": SimNode(f"{node_prefix}-{i}", self.shape) for i in range(nodes)
        }
        self._own_scratch = scratch_root is None
        self.scratch_root = Path(scratch_root or tempfile.mkdtemp(prefix="rljob-kubelet-")).resolve()
        # emptyDir medium Memory is a tmpfs on a kubelet: here one directory per pod under /dev/shm.
        shm = Path("/dev/shm")
        self.memory_root = Path(tempfile.mkdtemp(prefix="rljob-kubelet-", dir=shm)) if shm.is_dir() else None
        self.ips = ips
        self.max_grace = max_grace
        self.backoff = backoff
        self.probe_period = probe_period
        self.tick = tick
        self.watch_read_timeout = watch_read_timeout
        self.lease_seconds = lease_seconds
        self.heartbeat = heartbeat
        self.status_every = status_every
        # Each pod's processes see the gang's stable names, as cluster DNS and the kubelet's /etc/hosts give
        # them (a hosts file per pod, bind-mounted in a mount namespace): default on where that works.
        self.pod_hosts = can_mount_pod_hosts() if pod_hosts is None else pod_hosts
        self._names: dict[str, PodName] = {}  # pod uid -> its stable name and IP, every kubelet's pods
        self._names_lock = threading.Lock()
        server = urlparse(self.api.access.server)
        self.service_env = {  # what a kubelet gives every container for the `kubernetes` service
            "KUBERNETES_SERVICE_HOST": server.hostname or HOST_IP,
            "KUBERNETES_SERVICE_PORT": str(server.port or 443),
        }
        self._runners: dict[str, PodRunner] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._streams: set[WatchStream] = set()  # open watches, closed by stop() to end them at once
        self._ignored: set[str] = set()  # uids of other namespaces' pods already logged

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    def start(self) -> Kubelet:
        for node in list(self._nodes.values()):
            self._register(node)
        for target, name in ((self._watch_loop, "watch pods"), (self._heartbeat_loop, "node heartbeats")):
            t = threading.Thread(target=target, name=f"kubelet {name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, grace: float = 2.0, deregister: bool = True) -> None:
        """Stops all processes (bounded by `grace`), the watch and the heartbeats. With `deregister`, the
        Nodes and their Leases are deleted, so the scheduler places nothing more on them; the pods stay
        in the API (bound to a node that is gone: the pod garbage collector removes them)."""
        self._stopping.set()
        with self._lock:
            runners = list(self._runners.values())
            streams = list(self._streams)
        for stream in streams:
            stream.close()
        for r in runners:
            r.request_stop(gone=False, grace=grace)
        for r in runners:
            r.join(timeout=grace + 10)
        for t in self._threads:
            t.join(timeout=self.watch_read_timeout + 10)
        if deregister:
            for name in self.node_names:
                self._deregister(name)
        if self._own_scratch:
            shutil.rmtree(self.scratch_root, ignore_errors=True)
        if self.memory_root is not None:
            shutil.rmtree(self.memory_root, ignore_errors=True)

    def __enter__(self) -> Kubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def runner(self, namespace: str, name: str, uid: str | None = None) -> PodRunner | None:
        """The pod's runner; with `uid`, that very pod's (a deleted pod's runner may outlive it a while
        beside the runner of a new pod of the same name)."""
        with self._lock:
            if uid is not None:  # runners are kept by uid: no walk over every pod (the shared-pods reaper
                # asks for each of its components twice a second)
                r = self._runners.get(uid)
                return r if r is not None and (r.namespace, r.pod_name) == (namespace, name) else None
            return next(
                (r for r in self._runners.values() if (r.namespace, r.pod_name) == (namespace, name)), None
            )

    # -- nodes -----------------------------------------------------------------------------------
    def add_node(self, name: str | None = None, shape: NodeShape | None = None) -> str:
        """Registers one more node while running (e.g. capacity for a Pending gang); returns its name."""
        with self._lock:
            index = len(self._nodes)
            while f"{self.node_prefix}-{index}" in self._nodes:
                index += 1
            node = SimNode(name or f"{self.node_prefix}-{index}", shape or self.shape)
            self._nodes[node.name] = node
        self._register(node)
        return node.name

    def remove_node(self, name: str) -> None:
        """Stops the node's pods (they stay in the API) and deletes the Node and its Lease."""
        with self._lock:
            self._nodes.pop(name, None)
            runners = [r for r in self._runners.values() if r.node_name == name]
        for r in runners:
            r.request_stop(gone=False, grace=self.max_grace)
        for r in runners:
            r.join(timeout=self.max_grace + 10)
        self._deregister(name)

    def _node_status(self, node: SimNode) -> JsonObj:
        now = _now()
        healthy = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        conditions = [
            {"type": kind, "status": status, "reason": reason, "message": "rljob fake kubelet",
             "lastHeartbeatTime": now, "lastTransitionTime": now}
            for kind, status, reason in healthy
        ]  # fmt: skip
        info = {
            "machineID": node.uid.replace("-", ""), "systemUUID": node.uid, "bootID": node.uid,
            "kernelVersion": platform.release(), "osImage": "rljob fake kubelet",
            "containerRuntimeVersion": "rljob-sim://0.1", "kubeletVersion": K8S_VERSION,
            "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
        }  # fmt: skip
        return {
            "capacity": node.shape.capacity(),
            "allocatable": node.shape.capacity(),
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": node.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},  # no kubelet API: no logs/exec
            "nodeInfo": info,
        }

    def _register(self, node: SimNode) -> None:
        """Creates the Node (labels as a GPU node's), posts its Ready status and creates its Lease."""
        labels = {
            "kubernetes.io/hostname": node.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": "rljob-sim-gpu",
            **({"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(node.shape.gpus)}
               if node.shape.gpus else {}),
            **node.shape.labels,
        }  # fmt: skip
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": labels}}
        try:
            node.uid = self.api.post("/api/v1/nodes", body)["metadata"]["uid"]
        except ApiError as exc:
            if exc.status != 409:
                raise
            node.uid = self.api.get(f"/api/v1/nodes/{node.name}")["metadata"]["uid"]
        self.api.merge_patch(f"/api/v1/nodes/{node.name}/status", {"status": self._node_status(node)})
        node.last_status = time.monotonic()
        self._renew_lease(node)

    def _lease_path(self, name: str = "") -> str:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases"
        return f"{path}/{name}" if name else path

    def _renew_lease(self, node: SimNode) -> None:
        spec = {
            "holderIdentity": node.name,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": _micro_now(),
        }
        try:
            self.api.merge_patch(self._lease_path(node.name), {"spec": spec})
        except ApiError as exc:
            if exc.status != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": node.name, "ownerReferences": [owner]},  # collected with the Node
                "spec": spec,
            }
            with contextlib.suppress(ApiError):  # 409: created meanwhile; renewed next beat
                self.api.post(self._lease_path(), lease)

    def _deregister(self, name: str) -> None:
        for path in (self._lease_path(name), f"/api/v1/nodes/{name}"):
            try:
                self.api.delete(path)
            except ApiError as exc:
                if exc.status != 404:
                    log.warning("deleting %s: %s", path, exc)
            except requests.RequestException as exc:
                log.warning("deleting %s: %s", path, exc)

    def _heartbeat_loop(self) -> None:
        # A node's kubelet renews its own Lease: a hundred nodes' renewals one after the other outlast the
        # 40 s Lease on a loaded API server, and the node lifecycle controller marks the nodes NotReady.
        with ThreadPoolExecutor(HEARTBEAT_WORKERS, thread_name_prefix="kubelet heartbeat") as pool:
            while not self._stopping.wait(self.heartbeat):
                with self._lock:
                    nodes = list(self._nodes.values())
                list(pool.map(self._heartbeat, nodes))

    def _heartbeat(self, node: SimNode) -> None:
        try:
            if time.monotonic() - node.last_status >= self.status_every:
                path = f"/api/v1/nodes/{node.name}/status"
                self.api.merge_patch(path, {"status": self._node_status(node)})
                node.last_status = time.monotonic()
            self._renew_lease(node)
        except ApiError as exc:
            if exc.status == 404 and node.name in self.node_names and not self._stopping.is_set():
                log.warning("node %s was deleted: registering it again, as a kubelet does", node.name)
                with contextlib.suppress(ApiError, requests.RequestException):
                    self._register(node)
            else:
                log.warning("heartbeat of %s: %s", node.name, exc)
        except requests.RequestException as exc:
            log.warning("heartbeat of %s: %s", node.name, exc)

    # -- API actions -----------------------------------------------------------------------------
    def force_delete(self, namespace: str, name: str, uid: str) -> None:
        """Deletes with grace 0, as a kubelet does once the pod's containers have stopped."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        try:
            self.api.delete(pod_path(namespace, name), body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("deleting %s/%s: %s", namespace, name, exc)
        except requests.RequestException as exc:  # the API server is down: the next list finalizes it
            log.warning("deleting %s/%s: %s", namespace, name, exc)

    # -- pod names -------------------------------------------------------------------------------
    def note_name(self, pod: JsonObj, ip: str | None) -> None:
        """A pod with a hostname and a subdomain has a stable name once it has an IP; every running
        pod of its namespace gets it in its hosts file."""
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if not ip or not spec.get("subdomain") or meta.get("deletionTimestamp"):
            return
        name = PodName(meta["namespace"], spec.get("hostname") or meta["name"], spec["subdomain"], ip)
        with self._names_lock:
            if self._names.get(meta["uid"]) == name:
                return
            self._names[meta["uid"]] = name
        self.refresh_hosts(name.namespace)

    def forget_name(self, uid: str) -> None:
        with self._names_lock:
            name = self._names.pop(uid, None)
        if name is not None:
            self.refresh_hosts(name.namespace)

    def refresh_hosts(self, namespace: str) -> None:
        with self._lock:
            runners = [r for r in self._runners.values() if r.namespace == namespace and r.pod_ip]
        for r in runners:
            self.write_hosts(r)

    def write_hosts(self, runner: PodRunner) -> None:
        with self._names_lock:
            gang = [n for n in self._names.values() if n.namespace == runner.namespace]
        path = getattr(runner, "hosts_file", None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):  # the pod's scratch is gone: it has stopped
                write_in_place(path, hosts_file_text(runner.pod, runner.pod_ip, gang))

    def in_pod(self, runner: PodRunner, argv: list[str]) -> list[str]:
        """The container's process in a mount and UTS namespace of its own: the pod's hosts file over
        /etc/hosts and the pod's hostname (what gethostname() answers, e.g. for gloo's address)."""
        if not self.pod_hosts:
            return argv
        self.write_hosts(runner)
        hostname = (runner.pod.get("spec") or {}).get("hostname") or runner.pod_name
        return ["unshare", "--mount", "--uts", "sh", "-c", HOSTS_WRAPPER, str(runner.hosts_file), hostname,
                *argv]  # fmt: skip

    def forget(self, uid: str, runner: PodRunner) -> None:
        with self._lock:
            if self._runners.get(uid) is runner:
                del self._runners[uid]

    # -- watching --------------------------------------------------------------------------------
    # Every bound pod of the cluster, filtered here by node: one watch for all of this kubelet's nodes
    # (a real kubelet watches `spec.nodeName=<its node>`).
    _PODS = "/api/v1/pods"
    _BOUND = "spec.nodeName!="

    def _watch_loop(self) -> None:
        rv = ""
        while not self._stopping.is_set():
            try:
                if not rv:
                    listing = self.api.get(self._PODS, fieldSelector=self._BOUND)
                    rv = listing["metadata"]["resourceVersion"]
                    self._resync(listing.get("items") or [])
                stream = self.api.watch(self._PODS, rv, self.watch_read_timeout, field_selector=self._BOUND)
                with self._lock:
                    self._streams.add(stream)
                try:
                    for event in stream:
                        if self._stopping.is_set():
                            break
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            rv = "" if obj.get("code") == 410 else rv  # expired: list again
                            break
                        rv = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._on_event(event["type"], obj)
                finally:
                    with self._lock:
                        self._streams.discard(stream)
                    stream.close()
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
                continue  # an idle read timed out: resume from rv (and notice a stop)
            except ApiError as exc:
                rv = "" if exc.status == 410 else rv
                log.warning("watch pods: %s", exc)
                self._stopping.wait(1.0)
            except Exception:
                log.exception("watch pods")
                self._stopping.wait(1.0)

    def _resync(self, pods: list[JsonObj]) -> None:
        present = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            vanished = [r for uid, r in self._runners.items() if uid not in present]
        for r in vanished:
            r.request_stop(gone=True, grace=self.max_grace)
        for pod in pods:
            self._on_event("ADDED", pod)

    def serves(self, namespace: str) -> bool:
        return not self.namespaces or namespace in self.namespaces

    def _on_event(self, kind: str, pod: JsonObj) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if kind == "DELETED":
            self.forget_name(meta["uid"])
        else:
            self.note_name(pod, (pod.get("status") or {}).get("podIP"))
        if spec.get("nodeName") not in self.node_names:
            return  # another kubelet's node
        uid = meta["uid"]
        with self._lock:
            runner = self._runners.get(uid)
            if kind == "DELETED":
                if runner is not None:
                    runner.request_stop(gone=True, grace=self._grace_of(pod))
                return
            if meta.get("deletionTimestamp"):
                if runner is not None:
                    runner.request_delete(self._grace_of(pod))
                elif not self._stopping.is_set():
                    self.force_delete(meta["namespace"], meta["name"], uid)  # nothing runs: done at once
                return
            if not self.serves(meta["namespace"]):
                if uid not in self._ignored:
                    self._ignored.add(uid)
                    log.info("not running %s/%s: namespace not served", meta["namespace"], meta["name"])
                return
            if runner is not None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            if self._stopping.is_set():
                return
            runner = PodRunner(self, pod)
            self._runners[uid] = runner
        runner.start()

    def _grace_of(self, pod: JsonObj) -> float:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        return min(float(grace), self.max_grace)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rljob.testing.kubelet", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--kubeconfig", default=os.environ.get("KUBECONFIG"), required=not os.environ.get("KUBECONFIG")
    )
    parser.add_argument("--namespace", "-n", action="append", default=[], help="repeatable; default: all")
    parser.add_argument("--nodes", type=int, default=2, help="simulated GPU nodes (default 2)")
    parser.add_argument("--gpus-per-node", type=int, default=NodeShape.gpus, help="nvidia.com/gpu per node")
    parser.add_argument("--cpu-per-node", default=NodeShape.cpu)
    parser.add_argument("--memory-per-node", default=NodeShape.memory)
    parser.add_argument("--node-prefix", default=NODE_PREFIX, help="nodes are PREFIX-0, PREFIX-1, ...")
    parser.add_argument("--scratch", default=None, help="per-pod scratch root (default: a temp dir)")
    parser.add_argument("--first-ip", default="127.0.0.2", help="first loopback pod IP")
    parser.add_argument("--max-grace", type=float, default=10.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shape = NodeShape(gpus=args.gpus_per_node, cpu=args.cpu_per_node, memory=args.memory_per_node)
    kubelet = Kubelet(
        args.kubeconfig, args.namespace, nodes=args.nodes, shape=shape, node_prefix=args.node_prefix,
        scratch_root=args.scratch, ips=IpAllocator(args.first_ip), max_grace=args.max_grace,
    )  # fmt: skip
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    kubelet.start()
    log.info("fake kubelet: nodes %s (%s each), running pods of %s; scratch %s", kubelet.node_names,
             shape.capacity(), args.namespace or "all namespaces", kubelet.scratch_root)  # fmt: skip
    done.wait()
    kubelet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
