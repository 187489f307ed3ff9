"""Command line of `rljob-agent`. Every flag has an env default: the operator injects env into the pod."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from rljob.agent.gpu_probe import check_probe_name
from rljob.api.spec import DEFAULT_ENGINE, EngineKind, RefitSource


@dataclass(frozen=True)
class AgentConfig:
    listen: tuple[str, int]
    trainer_listen: tuple[str, int]
    engine_server_url: str  # the engine's HTTP API in the pod
    token: str
    gpu_probe: str
    log_json: bool
    engine_api_key: str | None  # the key the engine's normal routes take (and lifecycle ones without admin)
    engine_admin_api_key: str | None  # the only key the engine's lifecycle routes take, where it has one
    call_timeout_s: float  # bound on engine calls made outside a command deadline
    rollout_sample_s: float
    rollout_report_s: float  # rollout-only changes bump the revision at most this often
    node_rank: int = 0  # the pod's node rank in its engine instance (RLJOB_NODE_RANK): 0 leads, > 0 follows
    group_init_timeout_s: float = 1860.0  # > torch's 30-min rendezvous timeout that an engine's side waits
    scheduler_probe_timeout_s: float = 5.0  # the engine's hang check, where it needs one (Engine.hang_check)
    liveness_s: float = 1.0  # how often the agent asks the engine whether it lives (agent/watch.py)
    state_dir: str | None = None  # the pod-local record (agent/record.py); None: no recovery on restart
    engine_listen: tuple[str, int] | None = None  # the engine's framework endpoint (its folder's)
    refit_source: RefitSource | None = None  # the RLJob's spec.refit.source (the endpoint checks pushes)
    engine: EngineKind = DEFAULT_ENGINE  # which engine the pod runs (agent/engines/)
    keep_released_weights: bool = False  # where the engine chooses per release, keep weights on the host


def parse_hostport(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[v6]:PORT` or `:PORT` (all interfaces)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rljob-agent", description="In-pod agent between the operator and the inference engine."
    )
    p.add_argument(
        "--listen",
        type=parse_hostport,
        default=_env("RLJOB_AGENT_LISTEN", "127.0.0.1:8471"),
        help="operator-facing API, HOST:PORT (env RLJOB_AGENT_LISTEN; the operator passes the pod IP)",
    )
    p.add_argument(
        "--trainer-listen",
        type=parse_hostport,
        default=_env("RLJOB_TRAINER_LISTEN", "127.0.0.1:8472"),
        help="trainer-facing API, loopback only, no token (env RLJOB_TRAINER_LISTEN)",
    )
    p.add_argument(
        "--engine-listen",
        type=parse_hostport,
        default=_env("RLJOB_ENGINE_LISTEN"),
        help="the engine-compatible endpoint for a framework (slime, verl, AReaL), loopback only, no token "
        "(env RLJOB_ENGINE_LISTEN; the engine's framework endpoint); unset: none",
    )
    p.add_argument(
        "--refit-source",
        choices=[s.value for s in RefitSource],
        default=_env("RLJOB_REFIT_SOURCE"),
        help="the RLJob's refit source (env RLJOB_REFIT_SOURCE): the endpoint refuses other pushes",
    )
    p.add_argument(
        "--engine",
        choices=[k.value for k in EngineKind],
        default=_env("RLJOB_ENGINE", DEFAULT_ENGINE.value),
        help=f"the inference engine in the pod (env RLJOB_ENGINE; default {DEFAULT_ENGINE.value})",
    )
    p.add_argument(
        "--keep-released-weights",
        action="store_true",
        default=_env("RLJOB_KEEP_RELEASED_WEIGHTS", "") == "1",
        help="where the engine chooses per release whether released weights survive, keep them (a host "
        "copy, at its cost: docs/agent.md): a lease given back without weights then needs no reload "
        "(env RLJOB_KEEP_RELEASED_WEIGHTS=1)",
    )
    p.add_argument(
        "--engine-server-url",
        default=_env("RLJOB_ENGINE_SERVER_URL", "http://127.0.0.1:30000"),
        help="the engine's HTTP server in the pod (env RLJOB_ENGINE_SERVER_URL)",
    )
    p.add_argument(
        "--token-file",
        default=_env("RLJOB_AGENT_TOKEN_FILE"),
        help="bearer token the operator must present (env RLJOB_AGENT_TOKEN_FILE); required",
    )
    p.add_argument(
        "--engine-api-key-file",
        default=_env("RLJOB_ENGINE_API_KEY_FILE"),
        help="the engine's API key, if it runs with one (env RLJOB_ENGINE_API_KEY_FILE)",
    )
    p.add_argument(
        "--engine-admin-api-key-file",
        default=_env("RLJOB_ENGINE_ADMIN_API_KEY_FILE"),
        help="the engine's admin API key, if it runs with one: lifecycle routes then take only this key "
        "(env RLJOB_ENGINE_ADMIN_API_KEY_FILE)",
    )
    p.add_argument(
        "--gpu-probe",
        default=_env("RLJOB_GPU_PROBE", "nvml"),
        help="how freed GPU memory is verified: `nvml`, or a plugin `package.module:factory` called with "
        "the agent's engine (env RLJOB_GPU_PROBE)",
    )
    p.add_argument(
        "--log-json",
        action="store_true",
        default=_env("RLJOB_AGENT_LOG_JSON", "") == "1",
        help="one JSON object per log line (env RLJOB_AGENT_LOG_JSON=1)",
    )
    p.add_argument(
        "--call-timeout",
        type=float,
        default=float(_env("RLJOB_AGENT_CALL_TIMEOUT", "300") or 300),
        help="seconds any engine call may take when no command deadline applies",
    )
    p.add_argument(
        "--rollout-sample-seconds",
        type=float,
        default=1.0,
        help="how often the engine's load is sampled while Serving",
    )
    p.add_argument(
        "--rollout-report-seconds",
        type=float,
        default=10.0,
        help="rollout-only changes bump the state revision at most this often",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=int(_env("RLJOB_NODE_RANK", "0") or 0),
        help="the pod's node rank in its engine instance (env RLJOB_NODE_RANK, set by the operator): 0 leads "
        "and calls the engine; a follower (> 0) has no engine API and only checks its own GPUs",
    )
    p.add_argument(
        "--group-init-timeout",
        type=float,
        default=1860.0,
        help="seconds the engine's background join of a weights group may take: longer than the 30 min its "
        "rendezvous waits for the trainer, so that the agent hears the engine's own answer",
    )
    p.add_argument(
        "--scheduler-probe-timeout",
        type=float,
        default=5.0,
        help="client timeout of each probe of the engine's hang check (Engine.hang_check), for an engine "
        "whose HTTP server may outlive its scheduler",
    )
    p.add_argument(
        "--engine-liveness-seconds",
        type=float,
        default=1.0,
        help="how often the agent checks that the engine lives (its liveness route, and its hang check "
        "where it needs one): a dead engine fails the pod within about this long",
    )
    p.add_argument(
        "--state-dir",
        default=_env("RLJOB_AGENT_STATE_DIR"),
        help="pod-scoped directory (an emptyDir) for the agent's record: a restarted agent continues from it "
        "instead of starting over (env RLJOB_AGENT_STATE_DIR); unset: no record",
    )
    return p


def _read_secret(path: str, what: str) -> str:
    value = Path(path).read_text().strip()
    if not value:
        raise SystemExit(f"rljob-agent: {what} file {path} is empty")
    return value


def parse_config(argv: list[str] | None = None) -> AgentConfig:
    p = _parser()
    args = p.parse_args(argv)
    for name in ("listen", "trainer_listen", "engine_listen"):
        if isinstance(getattr(args, name), str):  # env defaults are not run through `type`
            setattr(args, name, parse_hostport(getattr(args, name)))
    try:
        check_probe_name(args.gpu_probe)
    except ValueError as e:
        p.error(str(e))
    if not args.token_file:
        p.error("--token-file (or RLJOB_AGENT_TOKEN_FILE) is required: the operator API is never open")
    return AgentConfig(
        listen=args.listen,
        trainer_listen=args.trainer_listen,
        engine_server_url=args.engine_server_url.rstrip("/"),
        token=_read_secret(args.token_file, "token"),
        gpu_probe=args.gpu_probe,
        log_json=args.log_json,
        engine_api_key=(
            _read_secret(args.engine_api_key_file, "engine API key") if args.engine_api_key_file else None
        ),
        engine_admin_api_key=(
            _read_secret(args.engine_admin_api_key_file, "engine admin API key")
            if args.engine_admin_api_key_file
            else None
        ),
        call_timeout_s=args.call_timeout,
        rollout_sample_s=args.rollout_sample_seconds,
        rollout_report_s=args.rollout_report_seconds,
        node_rank=args.node_rank,
        group_init_timeout_s=args.group_init_timeout,
        scheduler_probe_timeout_s=args.scheduler_probe_timeout,
        liveness_s=args.engine_liveness_seconds,
        state_dir=args.state_dir or None,
        engine_listen=args.engine_listen or None,
        refit_source=RefitSource(args.refit_source) if args.refit_source else None,
        engine=EngineKind(args.engine),
        keep_released_weights=args.keep_released_weights,
    )
