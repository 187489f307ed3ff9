"""A test-world process's own memory on the emulated GPUs: the simulated trainer registers what it
allocates with the SGLang emulator (`POST /_emulator/processes`, emulator/gpu_processes.py) as its own pid,
so that NVML's per-process list the emulator serves shows it, the GPU's used memory counts it, and a resume
that does not fit beside it kills the emulator as it kills SGLang (C-MEM-RESUME-OOM)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request


class EmulatedGpuMemory:
    def __init__(self, sglang_url: str, headers: dict[str, str] | None = None, timeout: float = 30.0) -> None:
        self.url = sglang_url.rstrip("/") + "/_emulator/processes"
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout = timeout
        self.held = 0
        self._timer: threading.Timer | None = None

    def hold(self, nbytes: int) -> None:
        """Hold `nbytes` on every GPU from now (0 frees it all); an allocation that does not fit raises, as
        a CUDA OOM would (HTTPError 409)."""
        if nbytes == self.held:
            return
        body = json.dumps({"pid": os.getpid(), "bytes": nbytes}).encode()
        req = urllib.request.Request(self.url, body, self.headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout):
            pass
        self.held = nbytes

    def hold_for(self, nbytes: int, seconds: float) -> None:
        """Hold `nbytes` now and free it all `seconds` later (negative: until this process exits)."""
        if self._timer is not None:
            self._timer.cancel()
        self.hold(nbytes)
        if nbytes and seconds >= 0:
            self._timer = threading.Timer(seconds, self.hold, (0,))
            self._timer.daemon = True
            self._timer.start()

    def free_on(self, signum: int = signal.SIGUSR1) -> None:
        """Free everything held when this process gets `signum` (the test world's "the offload finished")."""

        def handler(_signum: int, _frame: object) -> None:
            threading.Thread(target=self.hold, args=(0,), name="free-gpu", daemon=True).start()

        signal.signal(signum, handler)
