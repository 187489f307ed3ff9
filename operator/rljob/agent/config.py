"""Command line of `rljob-agent`. Every flag has an env default: the operator injects env into the pod."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from rljob.agent.gpu_probe import check_probe_name
from rljob.api.spec import RefitSource


@dataclass(frozen=True)
class AgentConfig:
    listen: tuple[str, int]
    trainer_listen: tuple[str, int]
    sglang_url: str
    token: str
    gpu_probe: str
    log_json: bool
    sglang_api_key: str | None  # SGLang --api-key: normal routes (and lifecycle ones without an admin key)
    sglang_admin_api_key: str | None  # SGLang --admin-api-key: the only key lifecycle routes accept then
    call_timeout_s: float  # bound on SGLang calls made outside a command deadline
    rollout_sample_s: float
    rollout_report_s: float  # rollout-only changes bump the revision at most this often
    node_rank: int = 0  # the pod's SGLang node rank (RLJOB_NODE_RANK): 0 leads, > 0 follows
    group_init_timeout_s: float = 1860.0  # > torch's 30-min rendezvous timeout that SGLang uses
    scheduler_probe_timeout_s: float = 5.0  # bounded /get_load when /ping cannot tell (C-DEATH-HARD)
    liveness_s: float = 1.0  # how often the agent asks SGLang whether it lives (agent/watch.py)
    state_dir: str | None = None  # the pod-local record (agent/record.py); None: no recovery on restart
    engine_listen: tuple[str, int] | None = None  # the framework endpoint (agent/engines/sglang/endpoint.py)
    refit_source: RefitSource | None = None  # the RLJob's spec.refit.source (the endpoint checks pushes)


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
        prog="rljob-agent", description="In-pod agent between the operator and SGLang."
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
        help="SGLang-compatible endpoint for a framework (slime, verl, AReaL), loopback only, no token "
        "(env RLJOB_ENGINE_LISTEN; agent/engines/sglang/endpoint.py); unset: none",
    )
    p.add_argument(
        "--refit-source",
        choices=[s.value for s in RefitSource],
        default=_env("RLJOB_REFIT_SOURCE"),
        help="the RLJob's refit source (env RLJOB_REFIT_SOURCE): the endpoint refuses other pushes",
    )
    p.add_argument(
        "--sglang-url",
        default=_env("RLJOB_SGLANG_URL", "http://127.0.0.1:30000"),
        help="SGLang server in the pod (env RLJOB_SGLANG_URL)",
    )
    p.add_argument(
        "--token-file",
        default=_env("RLJOB_AGENT_TOKEN_FILE"),
        help="bearer token the operator must present (env RLJOB_AGENT_TOKEN_FILE); required",
    )
    p.add_argument(
        "--sglang-api-key-file",
        default=_env("RLJOB_SGLANG_API_KEY_FILE"),
        help="SGLang's --api-key, if it runs with one (env RLJOB_SGLANG_API_KEY_FILE)",
    )
    p.add_argument(
        "--sglang-admin-api-key-file",
        default=_env("RLJOB_SGLANG_ADMIN_API_KEY_FILE"),
        help="SGLang's --admin-api-key, if it runs with one: lifecycle routes then take only this key "
        "(env RLJOB_SGLANG_ADMIN_API_KEY_FILE)",
    )
    p.add_argument(
        "--gpu-probe",
        default=_env("RLJOB_GPU_PROBE", "nvml"),
        help="how freed GPU memory is verified: `nvml`, or a plugin `package.module:factory` called with "
        "the agent's SGLang client (env RLJOB_GPU_PROBE)",
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
        help="seconds any SGLang call may take when no command deadline applies",
    )
    p.add_argument(
        "--rollout-sample-seconds",
        type=float,
        default=1.0,
        help="how often SGLang's load endpoint is sampled while Serving",
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
        help="the pod's SGLang node rank in its instance (env RLJOB_NODE_RANK, set by the operator): 0 leads "
        "and calls SGLang; a follower (> 0) has no SGLang API and only checks its own GPUs",
    )
    p.add_argument(
        "--group-init-timeout",
        type=float,
        default=1860.0,
        help="seconds the background init_weights_update_group may take: longer than the 30 min SGLang's "
        "rendezvous waits for the trainer, so that the agent hears SGLang's own answer",
    )
    p.add_argument(
        "--scheduler-probe-timeout",
        type=float,
        default=5.0,
        help="SGLang without a subprocess watchdog (0.5.6): client timeout of the /get_load probe; two "
        "timeouts in a row with no control call in flight mean the scheduler is dead",
    )
    p.add_argument(
        "--sglang-liveness-seconds",
        type=float,
        default=1.0,
        help="how often the agent checks that SGLang lives (/ping, and the /get_load probe where SGLang "
        "has no watchdog): a dead SGLang fails the pod within about this long",
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
        sglang_url=args.sglang_url.rstrip("/"),
        token=_read_secret(args.token_file, "token"),
        gpu_probe=args.gpu_probe,
        log_json=args.log_json,
        sglang_api_key=(
            _read_secret(args.sglang_api_key_file, "SGLang API key") if args.sglang_api_key_file else None
        ),
        sglang_admin_api_key=(
            _read_secret(args.sglang_admin_api_key_file, "SGLang admin API key")
            if args.sglang_admin_api_key_file
            else None
        ),
        call_timeout_s=args.call_timeout,
        rollout_sample_s=args.rollout_sample_seconds,
        rollout_report_s=args.rollout_report_seconds,
        node_rank=args.node_rank,
        group_init_timeout_s=args.group_init_timeout,
        scheduler_probe_timeout_s=args.scheduler_probe_timeout,
        liveness_s=args.sglang_liveness_seconds,
        state_dir=args.state_dir or None,
        engine_listen=args.engine_listen or None,
        refit_source=RefitSource(args.refit_source) if args.refit_source else None,
    )
