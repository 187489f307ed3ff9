"""Command line of the vLLM emulator: `vllm serve`'s launch flags that matter to the RL lifecycle (others
are ignored with a warning), the environment variables vLLM reads for it, and emulator-only flags
(version, memory sizes, speed, faults)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from rljob.emulator.fatal import StartupError
from rljob.emulator.faults import Faults, add_route_fault_flags, route_faults
from rljob.emulator.launch import DeviceConfig, add_emulator_flags, device_fields, parse_flags
from rljob.emulator.vllm.versions import RECORDED_VERSIONS, VllmProfile, check_recorded

log = logging.getLogger("vllm.emulator")
# vLLM's weight-transfer backends per version (…/config/weight_transfer.py:9-15@0.26.0, :12@0.34.0).
TRANSFER_BACKENDS = {
    "0.26.0": ("nccl", "ipc", "sparse_nccl"),
    "0.34.0": ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n"),
}


@dataclass
class VllmFaults(Faults):
    """The shared route faults plus vLLM's own."""

    # V-KILL-SLEEP-ASSERT: another process allocates on the GPU while /sleep runs, so the worker's
    # "memory did not grow" assert fails after it unmapped.
    sleep_memory_grows: bool = False


@dataclass
class LaunchConfig(DeviceConfig):
    profile: VllmProfile
    host: str | None  # None: every interface (V-LAUNCH-HOST)
    port: int
    model: str
    served_model_names: list[str]
    enable_sleep_mode: bool
    weight_transfer_backend: str | None  # --weight-transfer-config's backend; None without the flag
    tp_size: int
    pp_size: int
    dp_size: int
    api_keys: list[str]
    log_stats: bool
    server_load_tracking: bool
    load_format: str
    max_num_seqs: int
    max_model_len: int
    offload_cudagraph: bool  # --sleep-mode-offload-cudagraph (0.34)
    worker_extension_cls: str
    dev_mode: bool  # VLLM_SERVER_DEV_MODE=1
    insecure_serialization: bool  # VLLM_ALLOW_INSECURE_SERIALIZATION=1
    keep_alive_on_engine_death: bool  # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1
    watchdog_seconds: float
    faults: VllmFaults
    unknown_flags: list[str] = field(default_factory=list)

    def memory_saver(self) -> tuple[bool, bool]:
        """Only with --enable-sleep-mode are the regions in the cumem pool that sleeps."""
        return self.enable_sleep_mode, self.offload_cudagraph

    @property
    def served_model_name(self) -> str:
        """The name metrics and responses carry: the first one (…/config/model.py get_served_model_name)."""
        return self.served_model_names[0]

    @property
    def world_size(self) -> int:
        """Workers of one DP engine: TP x PP."""
        return self.tp_size * self.pp_size


def _env_flag(name: str) -> bool:
    """vllm.envs reads these as `bool(int(os.getenv(name, "0")))` (…/envs.py@0.26.0)."""
    try:
        return bool(int(os.environ.get(name, "0")))
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rljob.emulator.vllm", description=__doc__)
    v = p.add_argument_group("vllm serve flags")
    v.add_argument("model_tag", nargs="?", default=None, help="the model (as `vllm serve MODEL`)")
    v.add_argument("--model", default=None)
    v.add_argument("--host", default=None)
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", nargs="+", default=None)
    v.add_argument("--enable-sleep-mode", action="store_true")
    v.add_argument("--weight-transfer-config", default=None, help='JSON, e.g. {"backend": "ipc"}')
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    v.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    v.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    v.add_argument("--api-key", nargs="+", default=None)
    v.add_argument("--disable-log-stats", action="store_true")
    v.add_argument("--enable-server-load-tracking", action="store_true")
    v.add_argument("--load-format", default="auto")
    v.add_argument("--max-num-seqs", type=int, default=256)
    v.add_argument("--max-model-len", type=int, default=32768)
    v.add_argument("--sleep-mode-offload-cudagraph", action="store_true")
    v.add_argument("--worker-extension-cls", default="")
    e = add_emulator_flags(
        p, engine="vLLM", recorded=RECORDED_VERSIONS, default_version=None, gpus_default="TP x PP x DP"
    )
    e.add_argument(
        "--engine-death-watchdog-seconds",
        type=float,
        default=5.0,
        help="how often the API server checks for a dead engine core and exits (vLLM: 5 s, "
        "VLLM_WATCHDOG_TIME_S in …/entrypoints/launcher.py@0.26.0)",
    )
    f = add_route_fault_flags(p)
    f.add_argument("--fault-sleep-memory-grows", action="store_true")
    return p


def _transfer_backend(raw: str | None, profile: VllmProfile) -> str | None:
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
    except ValueError as e:
        raise StartupError(f"--weight-transfer-config: not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise StartupError("--weight-transfer-config: expected a JSON object")
    backend = str(parsed.get("backend", "nccl"))  # WeightTransferConfig's default backend
    if backend not in TRANSFER_BACKENDS[profile.version]:
        choices = ", ".join(TRANSFER_BACKENDS[profile.version])
        raise StartupError(f"--weight-transfer-config: backend {backend!r} is not one of {choices}")
    return backend


def parse_config(argv: list[str]) -> LaunchConfig:
    args, unknown = parse_flags(
        _parser(), argv, version=lambda a: a.vllm_version, check_recorded=check_recorded, log=log
    )
    profile = VllmProfile(args.vllm_version)
    model = args.model_tag or args.model or "emulated/model"
    if args.sleep_mode_offload_cudagraph and profile.key < (0, 34, 0):
        log.warning("--sleep-mode-offload-cudagraph does not exist in vLLM %s; ignored", profile.version)
        args.sleep_mode_offload_cudagraph = False
    api_keys = list(args.api_key or [k for k in [os.environ.get("VLLM_API_KEY")] if k])
    gpus = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    cfg = LaunchConfig(
        **device_fields(args, gpus=gpus),
        profile=profile,
        host=args.host,
        port=args.port,
        model=model,
        served_model_names=list(args.served_model_name or [model]),
        enable_sleep_mode=args.enable_sleep_mode,
        weight_transfer_backend=_transfer_backend(args.weight_transfer_config, profile),
        tp_size=max(1, args.tensor_parallel_size),
        pp_size=max(1, args.pipeline_parallel_size),
        dp_size=max(1, args.data_parallel_size),
        api_keys=api_keys,
        log_stats=not args.disable_log_stats,
        server_load_tracking=args.enable_server_load_tracking,
        load_format=args.load_format,
        max_num_seqs=max(1, args.max_num_seqs),
        max_model_len=args.max_model_len,
        offload_cudagraph=args.sleep_mode_offload_cudagraph,
        worker_extension_cls=args.worker_extension_cls,
        dev_mode=_env_flag("VLLM_SERVER_DEV_MODE"),
        insecure_serialization=_env_flag("VLLM_ALLOW_INSECURE_SERIALIZATION"),
        keep_alive_on_engine_death=_env_flag("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"),
        watchdog_seconds=args.engine_death_watchdog_seconds,
        faults=VllmFaults(
            **route_faults(args),
            sleep_memory_grows=args.fault_sleep_memory_grows,
        ),
        unknown_flags=list(unknown),
    )
    return cfg


def server_info(cfg: LaunchConfig) -> dict[str, Any]:
    """V-ROUTE-SERVER-INFO's `vllm_config` as JSON: the launch facts an RL client reads (a subset of
    VllmConfig's keys, …/config/vllm.py:314-326@0.26.0)."""
    transfer = None if cfg.weight_transfer_backend is None else {"backend": cfg.weight_transfer_backend}
    return {
        "model_config": {
            "model": cfg.model,
            "served_model_name": cfg.served_model_name,
            "enable_sleep_mode": cfg.enable_sleep_mode,
            "max_model_len": cfg.max_model_len,
        },
        "parallel_config": {
            "tensor_parallel_size": cfg.tp_size,
            "pipeline_parallel_size": cfg.pp_size,
            "data_parallel_size": cfg.dp_size,
        },
        "load_config": {"load_format": cfg.load_format},
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs},
        "weight_transfer_config": transfer,
    }
