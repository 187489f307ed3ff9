"""Real vLLM 0.26.0 for the GPU tier: `vllm serve` launched as the pod's engine is (examples/rljob-vllm.yaml:
sleep mode, the IPC weight transfer, the dev routes, insecure serialization for the pickled IPC handles,
loopback), with the Triton attention backend (the pack carries no FlashAttention: docs/real-vllm.md), from
the site hack/real-vllm/unpack.sh unpacked (its PYTHONPATH is vLLM's own, not the tests'); whether it can
run here; a process handle shaped like the emulator's (url, call, alive, log_text). With
RLJOB_GPU_VLLM_STAND_IN=emulator the vLLM emulator (`python -m rljob.emulator.vllm`) stands in for it."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from agent_procs import PY, free_port
from real_server import RealServer

VERSION = "0.26.0"
STAND_IN_ENV = "RLJOB_GPU_VLLM_STAND_IN"
SITE_ENV = "RLJOB_VLLM_SITE"  # unpack.sh's: where the pack's packages are
DEFAULT_SITE = "/tmp/rv/site"
IPC = ("--weight-transfer-config", '{"backend":"ipc"}')
# docs/real-vllm.md says why each: the pod's launch (sleep mode, IPC weight transfer), Triton attention
# (no FlashAttention in the pack), half the card (a trainer beside it), the tiny model's dtype, no
# torch.compile and no CUDA graphs (the start of a first run with no compile cache; graphs stay resident
# through sleep, vllm#47654).
LAUNCH_FLAGS = (
    "--enable-sleep-mode",
    *IPC,
    "--attention-backend", "TRITON_ATTN",
    "--gpu-memory-utilization", "0.5",
    "--dtype", "bfloat16",
    "--max-model-len", "1024",
    "--enforce-eager",
)  # fmt: skip
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
START_LINES = re.compile(
    r"(Loading weights took|Model loading took|Available KV cache memory|init engine.*took|"
    r"Application startup complete).*"
)


def stand_in() -> bool:
    return os.environ.get(STAND_IN_ENV) == "emulator"


def site() -> Path:
    return Path(os.environ.get(SITE_ENV) or DEFAULT_SITE)


@functools.cache
def vllm_missing() -> str | None:
    """Why real vLLM cannot run here, or None (read from the unpacked site's metadata: no import)."""
    if stand_in():
        return None
    where = site()
    if not (where / f"vllm-{VERSION}.dist-info").is_dir():
        found = sorted(p.name for p in where.glob("vllm-*.dist-info")) if where.is_dir() else []
        if found:
            return f"{where} holds {found[0]}; this tier is written against vllm {VERSION}"
        return (
            f"no vllm {VERSION} in {where} (hack/real-vllm/pack.sh, then unpack.sh there: docs/real-vllm.md)"
        )
    if not (where / "vllm" / "_C_stable_libtorch.abi3.so").is_file():
        return f"{where} has no vllm/_C_stable_libtorch.abi3.so (a transfer of the pack is missing)"
    return None


def start_phases(log_text: str) -> list[str]:
    return [m.group(0).strip()[:240] for m in START_LINES.finditer(log_text)]


class RealVllm(RealServer):
    """`vllm serve MODEL` on loopback; `flags` replace LAUNCH_FLAGS."""

    ENGINE = "vLLM"
    READY_PATH = "/v1/models"  # the engine core is up by then

    def __init__(self, tmp: Path, model_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = VERSION
        self.flags = tuple(flags or LAUNCH_FLAGS)
        argv = [PY, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), *self.flags]  # fmt: skip
        operator_dir = Path(__file__).resolve().parents[2] / "operator"
        path = [str(site()), os.environ.get("PYTHONPATH", ""), str(operator_dir)]
        env = {**ENV, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        super().__init__("vllm", argv, tmp / f"vllm-{self.port}.log", env)

    def stop(self) -> None:
        """Stops it, then waits until the GPU memory it held is the driver's again (its engine core is a
        child process that exits after it)."""
        from gpu_helpers import GiB, wait_used_below

        before = getattr(self, "_used_before", None)
        super().stop()
        if before is not None:
            wait_used_below(before + GiB, timeout=60)

    def note_memory(self) -> None:
        from gpu_helpers import nvml_used

        self._used_before = nvml_used()
