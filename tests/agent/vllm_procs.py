"""The vLLM emulator as a real process for the agent tier, beside agent_procs.Emulator (SGLang's)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_procs import PY, EmulatorProc, Reply, free_port, wait_until

from rljob.emulator import tokens
from rljob.trainer.engines.sglang import packing

VLLM_VERSIONS = ("0.26.0", "0.34.0")
GARBAGE = tokens.GARBAGE_MARKER
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"  # GPU 0 of the emulator (rljob.testing.ipc_stand_in.UUID)
DEV_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def write_model(directory: Path, version: str, size: int = 16 << 10) -> Path:
    """A checkpoint directory (one safetensors file): 4 float32 tensors `model.layers.{i}.mlp.weight`."""
    from rljob.testing.trainer import make_tensors, write_checkpoint  # numpy, safetensors: only when used

    write_checkpoint(directory, version, make_tensors(version, size))
    return directory


def model_params(version: str = "1", size: int = 16 << 10) -> dict[str, tuple[int, ...]]:
    from rljob.testing.trainer import make_tensors

    return {name: tuple(a.shape) for name, a in make_tensors(version, size).items()}


class VllmEmulator(EmulatorProc):
    """`python -m rljob.emulator.vllm`; the first call waits until it listens."""

    what = "the vLLM emulator"

    def __init__(
        self,
        tmp: Path,
        version: str,
        *flags: str,
        env: dict[str, str] | None = None,
        dev_mode: bool = True,
        sleep_mode: bool = True,
        tps: float = 0,
        model: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = version
        model = model or write_model(tmp / f"launch-model-{self.port}", "1")
        argv = [PY, "-m", "rljob.emulator.vllm", str(model), "--vllm-version", version, "--host", "127.0.0.1"]
        argv += [
            "--port",
            str(self.port),
            "--tokens-per-second",
            str(tps),
            "--engine-death-watchdog-seconds",
            "0.2",
        ]
        if sleep_mode:
            argv.append("--enable-sleep-mode")
        full_env = {**(DEV_ENV if dev_mode else {}), **(env or {})}
        super().__init__(f"vllm-{version}", [*argv, *flags], tmp / f"vllm-{self.port}.log", full_env)

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Reply:
        r = self.call(method, path, body, **kw)
        assert r.status == 200, f"{method} {path}: {r.status} {r.text}"
        return r

    def engine(self, dp_rank: int = 0) -> dict[str, Any]:
        return dict(self.stats()["engines"][dp_rank])

    def regions(self) -> dict[str, int]:
        return dict(self.call("GET", "/_emulator/memory").body["gpus"][0]["regions"])

    def metric(self, name: str, **labels: str) -> float:
        """The value of one `/metrics` sample (labels: a subset that must match)."""
        for line in self.call("GET", "/metrics").text.splitlines():
            if not line.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no sample {name} {labels}")

    def complete(self, prompt: str = "a b c", max_tokens: int = 8, **extra: Any) -> Reply:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self.call("POST", "/v1/completions", body, timeout=60)

    def dies(self, text: str = "EngineCore encountered a fatal error", timeout: float = 15) -> None:
        code = self.wait_exit(timeout)
        assert code != 0, f"exit code {code}"
        assert text in self.log_text(), self.log_text()[-3000:]


class Background:
    """A call running in a thread: `.reply` once it answered (None if the connection dropped)."""

    def __init__(self, call: Callable[[], Reply]) -> None:
        self.reply: Reply | None = None
        self.dropped = False

        def run() -> None:
            try:
                self.reply = call()
            except OSError:
                self.dropped = True

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float = 30) -> Reply:
        self._thread.join(timeout)
        assert self.reply is not None, "the call did not answer"
        return self.reply


def start_long_request(emu: VllmEmulator, max_tokens: int = 100_000, prompt: str = "a b c") -> Background:
    """A request that runs until aborted, preempted or the server dies; waits until it is running."""
    bg = Background(lambda: emu.complete(prompt, max_tokens=max_tokens))
    wait_until(lambda: emu.stats()["running"] == 1, 10, "the request to run")
    return bg


def ipc_handles_pickled(uuid: str, shapes: dict[str, tuple[int, ...]], dtype: str = "float32") -> str:
    """vLLM's HTTP form of an unpacked IPC update: base64(pickle([{uuid: rebuild args}, ...])), the args
    a stand-in for `reduce_tensor` of each tensor (rljob.testing.ipc_stand_in)."""
    from rljob.testing.ipc_stand_in import cuda_reduction

    itemsize = {"float32": 4, "bfloat16": 2, "uint8": 1}[dtype]
    handles = []
    for i, shape in enumerate(shapes.values()):
        n = itemsize
        for d in shape:
            n *= d
        args = cuda_reduction(n, dtype=dtype, shape=shape, device=0, handle=bytes([i + 1]) * 64).args
        handles.append({uuid: args})
    return packing.to_wire(packing.dumps(handles))


def packed_handle_pickled(uuid: str, nbytes: int) -> str:
    """One packed uint8 buffer: base64(pickle({uuid: rebuild args}))."""
    from rljob.testing.ipc_stand_in import cuda_reduction

    return packing.to_wire(packing.dumps({uuid: cuda_reduction(nbytes, device=0).args}))


def ipc_update(shapes: dict[str, tuple[int, ...]], uuid: str = UUID0) -> dict[str, Any]:
    return {
        "names": list(shapes),
        "dtype_names": ["float32"] * len(shapes),
        "shapes": [list(s) for s in shapes.values()],
        "ipc_handles_pickled": ipc_handles_pickled(uuid, shapes),
    }


def suppress_drop() -> contextlib.AbstractContextManager[None]:
    return contextlib.suppress(OSError)
