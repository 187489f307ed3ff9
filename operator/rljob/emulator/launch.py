"""What every engine's emulator launch has in common: the emulated GPUs (how many, their size and name,
the regions an engine keeps there, the memory backend behind them, the decode speed, the startup delay,
where stand-in IPC handles keep their bytes) and the parsing of a command line. Each engine's launch config
extends `DeviceConfig` and says which of its flags put the regions in the memory saver."""

from __future__ import annotations

import argparse
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rljob.emulator.fatal import StartupError
from rljob.emulator.memory import BACKENDS

GiB = 1 << 30


@dataclass
class DeviceConfig(ABC):
    gpus: int
    gpu_total_bytes: int
    baseline_bytes: int
    region_sizes: dict[str, int]
    memory_backend: str  # accounting (numbers only) | cuda (torch_memory_saver regions)
    memory_saver_hook_mode: str  # torch_memory_saver hook: preload (SGLang's) | torch
    tokens_per_second: float
    saturation_batch: int
    gpu_name: str
    startup_seconds: float
    ipc_stand_in_dir: str | None  # bytes behind stand-in IPC handles (tensor_refit.py), by handle hex

    @abstractmethod
    def memory_saver(self) -> tuple[bool, bool]:
        """Whether the regions can be released (the engine's memory saver or sleep mode is on), and
        whether the CUDA graphs are released with them."""


def parse_flags(
    parser: argparse.ArgumentParser,
    argv: list[str],
    *,
    version: Callable[[argparse.Namespace], str],
    check_recorded: Callable[[str], str | None],
    log: logging.Logger,
) -> tuple[argparse.Namespace, list[str]]:
    """The flags and, warned about, those the emulator does not model; an engine version the conformance
    document does not record is a StartupError."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        log.warning("ignoring launch flags the emulator does not model: %s", " ".join(unknown))
    unrecorded = check_recorded(version(args))
    if unrecorded is not None:
        raise StartupError(unrecorded)
    return args, unknown


def add_emulator_flags(
    parser: argparse.ArgumentParser,
    *,
    engine: str,
    recorded: Sequence[str],
    default_version: str | None,
    gpus_default: str,
) -> argparse._ArgumentGroup:
    """The "emulator" group: `--<engine>-version` (required where there is no default), then the flags of
    `DeviceConfig`; returns the group for the engine's own."""
    group = parser.add_argument_group("emulator")
    group.add_argument(
        f"--{engine.lower()}-version",
        default=default_version,
        required=default_version is None,
        help=f"the {engine} version to behave as; only those docs/{engine.lower()}-conformance.md records: "
        f"{', '.join(recorded)}",
    )
    add_device_flags(group, gpus_default=gpus_default)
    return group


def add_device_flags(group: argparse._ArgumentGroup, *, gpus_default: str) -> None:
    """The emulator's flags for `DeviceConfig`; `gpus_default` says how the engine counts its GPUs."""
    group.add_argument("--gpus", type=int, default=None, help=f"GPUs of the server (default: {gpus_default})")
    group.add_argument("--gpu-total-bytes", type=int, default=80 * GiB)
    group.add_argument("--baseline-bytes", type=int, default=2 * GiB, help="never released (context, NCCL)")
    group.add_argument("--weights-bytes", type=int, default=16 * GiB)
    group.add_argument("--kv-bytes", type=int, default=40 * GiB)
    group.add_argument("--graph-bytes", type=int, default=2 * GiB)
    group.add_argument(
        "--memory-backend",
        choices=BACKENDS,
        default="accounting",
        help="cuda: the regions are real CUDA memory through torch_memory_saver (needs torch, a GPU); "
        "--gpu-total-bytes and --baseline-bytes are then the GPU's own",
    )
    group.add_argument(
        "--memory-saver-hook-mode",
        choices=["preload", "torch"],
        default="preload",
        help="torch_memory_saver hook for --memory-backend cuda; preload re-executes the emulator with "
        "LD_PRELOAD set when it is not (SGLang sets it up the same way)",
    )
    group.add_argument("--tokens-per-second", type=float, default=50.0, help="per request; 0 = instant")
    group.add_argument(
        "--saturation-batch",
        type=int,
        default=64,
        help="running requests per DP rank at which its GPUs are fully busy; more share the same tokens/s "
        "(the busy fraction the GPU probe reports falls as batches shrink below it)",
    )
    group.add_argument(
        "--gpu-name",
        default="NVIDIA H100 80GB HBM3",
        help="the device name the emulator's GPU probe reports (what NVML's nvmlDeviceGetName says)",
    )
    group.add_argument(
        "--ipc-stand-in-dir",
        default=None,
        help="where the test world's trainers share the bytes behind their stand-in CUDA IPC handles (a file "
        "per handle, named by its hex): the accounting backend reads pushed tensors from there",
    )
    group.add_argument("--startup-seconds", type=float, default=0.0, help="delay before the port opens")


def device_fields(args: argparse.Namespace, *, gpus: int) -> dict[str, Any]:
    """`DeviceConfig`'s fields from the flags of `add_device_flags`; `gpus` where --gpus is not given."""
    return {
        "gpus": args.gpus or gpus,
        "gpu_total_bytes": args.gpu_total_bytes,
        "baseline_bytes": args.baseline_bytes,
        "region_sizes": {
            "weights": args.weights_bytes,
            "kv_cache": args.kv_bytes,
            "cuda_graph": args.graph_bytes,
        },
        "memory_backend": args.memory_backend,
        "memory_saver_hook_mode": args.memory_saver_hook_mode,
        "tokens_per_second": args.tokens_per_second,
        "saturation_batch": max(1, args.saturation_batch),
        "gpu_name": args.gpu_name,
        "startup_seconds": args.startup_seconds,
        "ipc_stand_in_dir": args.ipc_stand_in_dir,
    }
