"""Command line of the emulator: SGLang's launch_server flags that matter to the RL lifecycle (others are
ignored with a warning: the emulator cannot honour them) plus emulator-only flags (version, memory sizes,
speed, faults)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from rljob.emulator.fatal import StartupError
from rljob.emulator.faults import Faults, add_route_fault_flags, parse_renames, route_faults
from rljob.emulator.launch import DeviceConfig, add_emulator_flags, device_fields, parse_flags
from rljob.emulator.versions import DEFAULT_VERSION, RECORDED_VERSIONS, VersionProfile, check_recorded

log = logging.getLogger("sglang.emulator")


@dataclass
class EmulatorConfig(DeviceConfig):
    profile: VersionProfile
    host: str
    port: int
    model_path: str
    served_model_name: str
    weight_version: str
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool
    weight_cache_mode: str
    enable_metrics: bool
    fastapi_lazy_routers: bool  # FastAPI >= 0.137 installed beside SGLang (C-METRIC-LOAD-ASGI)
    api_key: str | None
    admin_api_key: str | None
    tp_size: int
    dp_size: int
    enable_dp_attention: bool
    max_total_tokens: int
    max_running_requests: int
    cuda_graph_in_memory_saver: bool  # env SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 at launch
    metrics_device_timer: bool  # env SGLANG_ENABLE_METRICS_DEVICE_TIMER at launch (C-METRIC-DEVICE-TIMER)
    health_check_timeout: float
    health_poll_seconds: float
    weight_update_group_timeout: float
    faults: Faults
    server_args: dict[str, Any] = field(default_factory=dict)  # what /server_info reports
    launch_command: str = ""
    prefill_graph_backend: str = "none"  # resolved prefill CUDA graph backend ("none": 0.5.6 has none)
    scheduler_kill_after_s: float = 0.0  # fault: the scheduler process dies this long after startup
    nnodes: int = 1  # nodes (pods) of the instance; only node rank 0 serves HTTP (emulator/nodes.py)
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of node 0, where the nodes meet

    def memory_saver(self) -> tuple[bool, bool]:
        return self.enable_memory_saver, self.cuda_graph_in_memory_saver


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rljob.emulator", description=__doc__)
    s = p.add_argument_group("SGLang launch_server flags")
    s.add_argument("--model-path", default="emulated/model")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--tokenizer-path", default=None)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--weight-version", default="default")
    s.add_argument("--enable-memory-saver", action="store_true")
    s.add_argument("--enable-weights-cpu-backup", action="store_true")
    s.add_argument("--enable-draft-weights-cpu-backup", action="store_true")
    s.add_argument("--weight-cache-mode", choices=["off", "daemon", "client"], default=None)
    s.add_argument("--enable-metrics", action="store_true")
    s.add_argument("--api-key", default=None)
    s.add_argument("--admin-api-key", default=None)
    s.add_argument("--tp-size", "--tp", type=int, default=1)
    s.add_argument("--dp-size", "--dp", type=int, default=1)
    s.add_argument("--enable-dp-attention", action="store_true")
    s.add_argument("--nnodes", type=int, default=1)
    s.add_argument("--node-rank", type=int, default=0)
    s.add_argument("--dist-init-addr", default=None)
    s.add_argument("--max-total-tokens", type=int, default=65536)
    s.add_argument("--max-running-requests", type=int, default=256)
    s.add_argument("--load-format", default="auto")
    s.add_argument("--skip-server-warmup", action="store_true")
    s.add_argument("--disable-cuda-graph", action="store_true")
    s.add_argument("--disable-prefill-cuda-graph", action="store_true")
    s.add_argument("--cuda-graph-backend-prefill", default=None)
    s.add_argument("--cuda-graph-config", default=None, help="JSON; only prefill.backend is read")
    s.add_argument("--mem-fraction-static", type=float, default=None)
    e = add_emulator_flags(
        p,
        engine="SGLang",
        recorded=RECORDED_VERSIONS,
        default_version=DEFAULT_VERSION,
        gpus_default="tp-size x dp-size",
    )
    e.add_argument(
        "--fastapi-lazy-routers",
        action="store_true",
        help="the server runs under FastAPI >= 0.137 (include_router keeps an _IncludedRouter): with "
        "--enable-metrics, /v1/loads answers 500 where SGLang's metrics middleware reads route.path "
        "(C-METRIC-LOAD-ASGI)",
    )
    e.add_argument("--health-check-timeout", type=float, default=None, help="default: env or 20 s")
    e.add_argument(
        "--health-poll-seconds",
        type=float,
        default=1.0,
        help="how often /health looks for scheduler output: SGLang sleeps 1 s before each look, so /health "
        "answers after 1 s at the earliest (C-HEALTH-GENERATE)",
    )
    e.add_argument(
        "--weight-update-group-timeout",
        type=float,
        default=1800.0,
        help="how long init_weights_update_group waits for the group to form (torch's default_pg_timeout)",
    )
    f = add_route_fault_flags(p)
    f.add_argument("--fault-release-unmap-delay", type=float, default=0.0, metavar="SECONDS")
    f.add_argument("--fault-resume-oom", action="append", default=[], metavar="TAG")
    f.add_argument("--fault-refit-fail", action="store_true")
    f.add_argument(
        "--fault-refit-noop",
        action="store_true",
        help="a refit answers success and records its version but moves no weights",
    )
    f.add_argument(
        "--fault-refit-store-as",
        action="append",
        default=[],
        metavar="TENSOR=TENSOR",
        help="a loaded or pushed tensor of the first name is stored in the parameter of the second",
    )
    f.add_argument(
        "--fault-refit-loads-launch",
        action="store_true",
        help="after a refit the engine holds the weights it launched with (it reports the refit's version)",
    )
    f.add_argument(
        "--fault-release-ignore",
        action="store_true",
        help="this node's ranks acknowledge a release and free nothing (a follower that keeps its memory)",
    )
    f.add_argument(
        "--fault-scheduler-kill-after",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="the scheduler process dies (SIGKILL, OOM-kill) this long after startup; 0.5.6 keeps HTTP up",
    )
    return p


def parse_config(argv: list[str]) -> EmulatorConfig:
    args, _ = parse_flags(
        _parser(), argv, version=lambda a: a.sglang_version, check_recorded=check_recorded, log=log
    )
    profile = VersionProfile(args.sglang_version)
    if args.weight_cache_mode is not None and not profile.has_weight_cache:
        log.warning("--weight-cache-mode does not exist in SGLang %s; ignored", profile.version)
        args.weight_cache_mode = None
    if args.admin_api_key is not None and not profile.has_admin_api_key:
        log.warning("--admin-api-key does not exist in SGLang %s; ignored", profile.version)
        args.admin_api_key = None
    env_timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
    if args.cuda_graph_backend_prefill is not None and not profile.prefill_graph_backends:
        log.warning("--cuda-graph-backend-prefill does not exist in SGLang %s; ignored", profile.version)
        args.cuda_graph_backend_prefill = None
    if args.cuda_graph_backend_prefill not in (None, *profile.prefill_graph_backends):
        raise StartupError(
            f"--cuda-graph-backend-prefill: invalid choice {args.cuda_graph_backend_prefill!r} "
            f"(choose from {', '.join(profile.prefill_graph_backends)})"
        )
    cfg = EmulatorConfig(
        **device_fields(args, gpus=max(1, args.tp_size * args.dp_size // max(1, args.nnodes))),
        profile=profile,
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        served_model_name=args.served_model_name or args.model_path,
        weight_version=args.weight_version,
        enable_memory_saver=args.enable_memory_saver,
        # The weight cache forces CPU backup off (docs/sglang-conformance.md, C-MEM-WEIGHT-CACHE).
        enable_weights_cpu_backup=args.enable_weights_cpu_backup
        and (args.weight_cache_mode or "off") == "off",
        weight_cache_mode=args.weight_cache_mode or "off",
        enable_metrics=args.enable_metrics,
        fastapi_lazy_routers=args.fastapi_lazy_routers,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        # get_bool_env_var: "true" or "1", any case (…/utils/common.py@0.5.6)
        cuda_graph_in_memory_saver=os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "").lower()
        in ("1", "true"),
        metrics_device_timer=_env_bool("SGLANG_ENABLE_METRICS_DEVICE_TIMER"),
        health_check_timeout=args.health_check_timeout
        if args.health_check_timeout is not None
        else env_timeout,
        health_poll_seconds=args.health_poll_seconds,
        weight_update_group_timeout=args.weight_update_group_timeout,
        faults=Faults(
            **route_faults(args),
            release_unmap_delay_s=args.fault_release_unmap_delay,
            resume_oom_tags=set(args.fault_resume_oom),
            refit_fail=args.fault_refit_fail,
            release_ignore=args.fault_release_ignore,
            refit_noop=args.fault_refit_noop,
            refit_store_as=parse_renames(args.fault_refit_store_as),
            refit_loads_launch=args.fault_refit_loads_launch,
        ),
    )
    cfg.prefill_graph_backend = _prefill_graph_backend(profile, args)
    cfg.scheduler_kill_after_s = args.fault_scheduler_kill_after
    cfg.nnodes, cfg.node_rank, cfg.dist_init_addr = args.nnodes, args.node_rank, args.dist_init_addr
    cfg.server_args = _server_args(cfg, args)
    cfg.launch_command = "python -m sglang.launch_server " + " ".join(argv)
    return cfg


def _env_bool(name: str) -> bool:
    """SGLang's EnvBool (…/environ.py:56-67,114-121@0.5.15.post1): true/1/yes/y, any case; any other value
    is False (an unparsable one with a warning, its default)."""
    value = os.environ.get(name)
    if value is not None and value.lower() not in ("true", "1", "yes", "y", "false", "0", "no", "n"):
        log.warning('Invalid value for %s: "%s" is not a valid boolean value, using default "False"',
                    name, value)  # fmt: skip
    return value is not None and value.lower() in ("true", "1", "yes", "y")


def _prefill_graph_backend(profile: VersionProfile, args: argparse.Namespace) -> str:
    """_parse_cuda_graph_config: default breakable on CUDA; --disable-cuda-graph, then
    --disable-prefill-cuda-graph, then --cuda-graph-backend-prefill, then the JSON config, each overriding
    the one before (…/server_args.py:3205-3235@0.5.15.post1,
    …/arg_groups/cuda_graph_hook.py:40-100@0.5.23)."""
    if not profile.prefill_graph_backends:
        return "none"
    backend = "breakable"  # …/model_executor/cuda_graph_config.py:95-101@0.5.15.post1, :119-123@0.5.23
    if args.disable_cuda_graph or args.disable_prefill_cuda_graph:
        backend = "disabled"
    if args.cuda_graph_backend_prefill is not None:
        backend = args.cuda_graph_backend_prefill
    if args.cuda_graph_config:
        try:
            backend = json.loads(args.cuda_graph_config).get("prefill", {}).get("backend", backend)
        except (ValueError, AttributeError) as e:
            raise StartupError(f"--cuda-graph-config: not a JSON object: {e}") from e
    return str(backend)


def startup_error(cfg: EmulatorConfig) -> str | None:
    """C-MEM-CUDAGRAPH-ENV: BreakableCudaGraphBackend.__init__ raises when the memory saver would hold the
    graphs (…/model_executor/runner_backend/breakable_cuda_graph_backend.py:77-86@0.5.15.post1,
    breakable_cuda_graph_backend.py:84-93@0.5.23): the scheduler dies while starting, launch fails. And the
    multi-node checks of ServerArgs (C-NODE)."""
    nodes = _nodes_error(cfg)
    if nodes is not None:
        return nodes
    if (
        cfg.profile.breakable_prefill_rejects_memory_saver_graph
        and cfg.enable_memory_saver
        and cfg.cuda_graph_in_memory_saver
        and cfg.prefill_graph_backend == "breakable"
    ):
        return "NotImplementedError: Breakable CUDA graph is not compatible with memory saver mode"
    return None


def _nodes_error(cfg: EmulatorConfig) -> str | None:
    """…/server_args.py:3975,3985,4437-4447@0.5.6; arg_groups/validation_hook.py:179,199-202@0.5.23."""
    if cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        return f"AssertionError: node_rank {cfg.node_rank} is not in [0, nnodes={cfg.nnodes})"
    if cfg.nnodes == 1:
        return None
    if cfg.dist_init_addr is None:
        return "AssertionError: please provide --dist-init-addr as host:port of head node"
    if cfg.tp_size % cfg.nnodes:
        return "AssertionError: tp_size must be divisible by number of nodes"
    # DP replicas cannot span nodes on any version (0.5.23 refuses them with DP attention too).
    if cfg.dp_size > 1 and not cfg.enable_dp_attention:
        return (
            "AssertionError: multi-node data-parallel replicas are not supported; use attention DP "
            "(--attn-dp-size) across nodes"
        )
    return None


def _server_args(cfg: EmulatorConfig, args: argparse.Namespace) -> dict[str, Any]:
    """The resolved launch config as /server_info reports it (a subset of SGLang's ServerArgs)."""
    out: dict[str, Any] = {
        "model_path": cfg.model_path,
        "tokenizer_path": args.tokenizer_path or cfg.model_path,
        "served_model_name": cfg.served_model_name,
        "host": cfg.host,
        "port": cfg.port,
        "weight_version": cfg.weight_version,
        "enable_memory_saver": cfg.enable_memory_saver,
        "enable_weights_cpu_backup": cfg.enable_weights_cpu_backup,
        "enable_draft_weights_cpu_backup": args.enable_draft_weights_cpu_backup,
        "enable_metrics": cfg.enable_metrics,
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "enable_dp_attention": cfg.enable_dp_attention,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "dist_init_addr": args.dist_init_addr,
        "load_format": args.load_format,
        "skip_server_warmup": args.skip_server_warmup,
        "disable_cuda_graph": args.disable_cuda_graph,
        "mem_fraction_static": args.mem_fraction_static,
        "max_running_requests": cfg.max_running_requests,
        "api_key": None,  # SGLang redacts secrets; so do we
    }
    if cfg.profile.has_weight_cache:
        out["weight_cache_mode"] = cfg.weight_cache_mode
    if cfg.profile.has_admin_api_key:
        out["admin_api_key"] = None
    return out
