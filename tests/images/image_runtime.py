"""Running a built image from its mounted root filesystem, for the images tier (see conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Image:
    """A built image, mounted: its root filesystem and its OCI config (User, Env, Entrypoint, Cmd)."""

    name: str
    ref: str
    rootfs: Path
    config: dict[str, Any]
    size: str

    @property
    def user(self) -> tuple[int, int]:
        uid, _, gid = str(self.config.get("User", "0")).partition(":")
        return int(uid), int(gid or uid)

    @property
    def env(self) -> list[str]:
        return list(self.config.get("Env") or [])

    @property
    def command(self) -> list[str]:
        """ENTRYPOINT + CMD: what `docker run IMAGE` runs."""
        return [*(self.config.get("Entrypoint") or []), *(self.config.get("Cmd") or [])]


def in_root(root: Path, path: str, hops: int = 16) -> Path:
    """`path` of the container resolved inside `root`: a symlink (Debian's /var/run -> /run) is followed
    within the image, never out to the host's file of that name."""
    current = root
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        candidate = current / part
        if candidate.is_symlink():
            if hops == 0:
                raise OSError(f"too many symlinks resolving {path} in {root}")
            target = os.readlink(candidate)
            base = "/" if target.startswith("/") else "/" + str(current.relative_to(root))
            rest = "/".join([target, *parts[i + 1 :]])
            return in_root(root, os.path.normpath(os.path.join(base, rest)), hops - 1)
        current = candidate
    return current


def mount_point(root: Path, path: str) -> Path:
    """The directory to mount on for `path`, created in the container's (writable) upper layer."""
    target = in_root(root, path)
    target.mkdir(parents=True, exist_ok=True)
    return target


@dataclass
class Bind:
    source: Path
    target: str
    read_only: bool = True


@dataclass
class Container:
    """A started container: its process (stdout/stderr to `log`), stopped by `stop()`."""

    proc: subprocess.Popen[bytes]
    log: Path
    stop_command: list[str] = field(default_factory=list)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.stop_command:
            subprocess.run(self.stop_command, capture_output=True, check=False, timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Runtime:
    """Runs a command of an image from its mounted root filesystem; see the module docstring."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # RLJOB_IMAGE_RUNTIME=chroot forces the fallback (to check it where runc exists too).
        self.kind = os.environ.get("RLJOB_IMAGE_RUNTIME") or ("runc" if shutil.which("runc") else "chroot")
        self.state = workdir / "runc-state"

    def _bundle(self, image: Image, argv: Sequence[str], binds: Sequence[Bind], tmpfs: Sequence[str]) -> Path:
        bundle = Path(tempfile.mkdtemp(dir=self.workdir, prefix=f"{image.name}-"))
        uid, gid = image.user
        # What a runtime gives every container (runc's `spec` defaults): /proc, a small /dev, read-only /sys.
        mounts: list[dict[str, Any]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
        ]  # fmt: skip
        for path in tmpfs:
            mounts.append(
                {
                    "destination": path,
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777"],
                }
            )
        for b in binds:
            mounts.append({"destination": b.target, "type": "bind", "source": str(b.source),
                           "options": ["rbind", "ro" if b.read_only else "rw"]})  # fmt: skip
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": uid, "gid": gid},
                "args": list(argv),
                "env": image.env,
                "cwd": image.config.get("WorkingDir") or "/",
                "capabilities": {
                    k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
                },
                "noNewPrivileges": True,
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            },
            "root": {"path": str(image.rootfs), "readonly": True},  # readOnlyRootFilesystem: true
            "hostname": f"rljob-{image.name}",
            "mounts": mounts,
            "linux": {
                # No network namespace: the host's loopback, so the test can reach the agent.
                "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            },
        }
        (bundle / "config.json").write_text(json.dumps(config, indent=2))
        return bundle

    def start(
        self, image: Image, argv: Sequence[str], binds: Sequence[Bind] = (), tmpfs: Sequence[str] = ()
    ) -> Container:
        log = Path(tempfile.mkstemp(dir=self.workdir, prefix=f"{image.name}-", suffix=".log")[1])
        with open(log, "wb") as out:
            if self.kind == "runc":
                bundle = self._bundle(image, argv, binds, tmpfs)
                cid = f"rljob-{image.name}-{uuid.uuid4().hex[:8]}"
                runc = ["runc", "--root", str(self.state)]
                proc = subprocess.Popen(
                    [*runc, "run", "--bundle", str(bundle), cid],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
                return Container(proc, log, [*runc, "delete", "--force", cid])
            proc = subprocess.Popen(
                self._chroot_argv(image, argv, binds, tmpfs), env=self._chroot_env(image),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            return Container(proc, log)

    def run(
        self, image: Image, argv: Sequence[str], binds: Sequence[Bind] = (), tmpfs: Sequence[str] = (),
        timeout: float = 120,
    ) -> tuple[int, str]:  # fmt: skip
        """Runs to completion: (exit code, stdout + stderr)."""
        container = self.start(image, argv, binds, tmpfs)
        try:
            code = container.proc.wait(timeout=timeout)
        finally:
            container.stop()
        return code, container.output()

    # -- without runc: a private mount namespace, the root bound read-only, chroot as the image's user --
    @staticmethod
    def _chroot_env(image: Image) -> dict[str, str]:
        return dict(e.split("=", 1) for e in image.env)

    @staticmethod
    def _chroot_argv(
        image: Image, argv: Sequence[str], binds: Sequence[Bind], tmpfs: Sequence[str]
    ) -> list[str]:
        root = str(image.rootfs)
        steps = [f"mount --bind {root} {root}", f"mount -o remount,bind,ro {root}",
                 f"mount -t proc proc {root}/proc"]  # fmt: skip
        for path in tmpfs:
            steps.append(f"mount -t tmpfs tmpfs {mount_point(image.rootfs, path)}")
        for b in binds:
            target = mount_point(image.rootfs, b.target)
            steps.append(f"mount --bind {b.source} {target}")
            if b.read_only:
                steps.append(f"mount -o remount,bind,ro {target}")
        uid, gid = image.user
        script = " && ".join(steps) + f' && exec chroot --userspec={uid}:{gid} {root} "$@"'
        return [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            "--",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]
