"""`kubectl rljob status NAME`: the phase timeline of recent iterations, per-pod state and versions,
where the wall-clock goes (the profile verdict) and the levers worth pulling (status.diagnosis).
`kubectl rljob profile NAME [--html FILE]`: the per-iteration profile (cli/profile_report.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rljob.api import parse_status
from rljob.api.crd import GROUP, PLURAL, VERSION
from rljob.api.spec import DEFAULT_ENGINE, EngineKind
from rljob.api.status import IterationReport, PhaseSpan, RLJobStatus, Signal
from rljob.cli.profile_report import (
    NOT_MEASURED,
    diagnosis_lines,
    engines,
    html_report,
    not_measured_lines,
    terminal_chart,
    unmeasured_in,
)


def _table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _bytes(n: int | None) -> str:
    if not n:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n}B"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}s"


def _signals(it: IterationReport) -> list[str]:
    """The rollout signals of docs/profiling.md, where measured."""
    parts = []
    if it.gpu_busy_fraction is not None:
        parts.append(f"GPU busy {it.gpu_busy_fraction:.0%} during rollout")
    if it.mean_running_requests is not None and it.mean_waiting_requests is not None:
        parts.append(
            f"{it.mean_running_requests:.1f} running / {it.mean_waiting_requests:.1f} waiting requests"
        )
    if it.tokens_per_second_per_gpu is not None:
        parts.append(f"{it.tokens_per_second_per_gpu:.0f} tok/s per GPU")
    if it.roofline_fraction is not None:
        parts.append(f"{it.roofline_fraction:.0%} of the decode roofline")
    if it.gpu_seconds_per_sample is not None:
        parts.append(f"{it.gpu_seconds_per_sample:.3g} GPU-s per sample")
    if it.tokens_per_gpu_second is not None:
        parts.append(f"{it.tokens_per_gpu_second:.0f} tokens per GPU-second")
    return ["  " + ", ".join(parts)] if parts else []


def _span_rate(span: PhaseSpan, value: float | None, fmt: str, signal: Signal) -> str | None:
    """A Rollout span's rate, or "not measured" where its agents said so (span.rollout.unmeasured)."""
    if value is not None:
        return format(value, fmt)
    if span.rollout is not None and any(e.signal == signal for e in span.rollout.unmeasured):
        return NOT_MEASURED
    return None


def _engine(spec: dict[str, Any]) -> str:
    """spec.engine as messages name it (an unknown one as written)."""
    try:
        return EngineKind(spec.get("engine", DEFAULT_ENGINE.value)).label
    except ValueError:
        return str(spec.get("engine"))


def render(name: str, namespace: str, status: RLJobStatus, spec: dict[str, Any]) -> str:
    out = [
        f"RLJob {namespace}/{name}",
        f"  Phase:      {status.phase.value}" + (f" ({status.reason})" if status.reason else ""),
        f"  Message:    {status.message or '-'}",
        f"  Iteration:  {status.iteration}" + (f" of {spec['iterations']}" if spec.get("iterations") else ""),
        f"  Weights:    {status.weight_version or '-'}"
        + (f" (refitting to {status.target_weights.version})" if status.target_weights else ""),
        f"  Ready:      {status.ready}    Restarts: {status.restarts}    Epoch: {status.epoch}",
        f"  Engine:     {_engine(spec)}" + (f" (pods report {engines(status)})" if engines(status) else ""),
    ]
    if status.conditions:
        out.append(
            "  Conditions: " + ", ".join(f"{c.type.value}={c.status.value}" for c in status.conditions)
        )
    out += ["", "Timeline (recent phases):"]
    out.append(
        _table(
            [
                (
                    s.iteration,
                    s.phase.value,
                    s.start_time,
                    _secs(s.seconds),
                    _secs(s.agent_seconds),
                    _secs(s.trainer_seconds),
                    _bytes(s.freed_bytes) if s.freed_bytes is not None else None,
                    _span_rate(s, s.cache_hit_rate, ".0%", Signal.CACHE_HIT_RATE),
                    _span_rate(s, s.tokens_per_second, ".0f", Signal.GENERATION_TOKENS_PER_SECOND),
                )
                for s in status.timeline[-18:]
            ],
            ["ITER", "PHASE", "STARTED", "WALL", "IN-AGENT", "TRAINER", "FREED", "CACHE-HIT", "TOK/S"],
        )
    )
    out += ["", "Pods:"]
    out.append(
        _table(
            [
                (
                    p.name,
                    p.stage,
                    p.weight_version,
                    ",".join(t.value for t in p.released_tags) or None,
                    _bytes(p.freed_bytes),
                    p.last_error,
                )
                for p in status.pods
            ],
            ["NAME", "STAGE", "WEIGHTS", "RELEASED", "FREED", "LAST-ERROR"],
        )
    )
    if status.last_iteration:
        it = status.last_iteration
        s = it.seconds
        out += ["", f"Last iteration ({it.iteration}):"]
        out.append(
            _table(
                [
                    (
                        _secs(s.rollout),
                        _secs(s.draining),
                        _secs(s.releasing),
                        _secs(s.training),
                        _secs(s.refitting),
                        _secs(s.resuming),
                        _secs(it.control_overhead_seconds),
                    )
                ],
                ["ROLLOUT", "DRAIN", "RELEASE", "TRAIN", "REFIT", "RESUME", "CONTROL-OVERHEAD"],
            )
        )
        hit = f"{it.cache_hit_rate:.0%}" if it.cache_hit_rate is not None else "-"
        tps = (
            f"{it.generation_tokens_per_second:.0f} tok/s"
            if it.generation_tokens_per_second is not None
            else "-"
        )
        if unmeasured_in(it, Signal.CACHE_HIT_RATE):
            hit = NOT_MEASURED
        if unmeasured_in(it, Signal.GENERATION_TOKENS_PER_SECOND):
            tps = NOT_MEASURED
        out.append(f"  freed {_bytes(it.freed_bytes)}, prefix-cache hit rate {hit}, generation {tps}")
        out.extend(_signals(it))
        out.extend(not_measured_lines(it.unmeasured))
    if status.profile:
        p = status.profile
        hint = {
            "RolloutBound": "rollout dominates: the levers below say which rollout lever",
            "TrainBound": "training dominates: the trainer, not the engine, is the lever",
            "Balanced": "rollout and training are comparable: the levers below rank both",
        }[p.verdict.value]
        out.append(f"  Profile: {p.verdict.value}, rollout {p.rollout_percent}% of rollout+train — {hint}")
    if status.last_iteration:
        out += ["", "Levers (largest share of the last iteration first):", *diagnosis_lines(status.diagnosis)]
    if status.weight_history:
        out += ["", "Weight history: " + " -> ".join(w.version for w in status.weight_history)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubectl rljob", description=__doc__)
    parser.add_argument("--kubeconfig")
    parser.add_argument("--context")
    parser.add_argument("-n", "--namespace")
    sub = parser.add_subparsers(dest="command", required=True)
    status_cmd = sub.add_parser("status", help="phase timeline, pods, versions and profile of one RLJob")
    status_cmd.add_argument("name")
    profile_cmd = sub.add_parser(
        "profile", help="per-iteration chart of where the wall-clock went, the rollout signals and the levers"
    )
    profile_cmd.add_argument("name")
    profile_cmd.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report here")
    args = parser.parse_args(argv)

    from rljob.kubeclient.apiserver import ApiError, ApiServer
    from rljob.kubeclient.credentials import ConfigError, Credentials

    try:
        credentials = Credentials.from_kubeconfig(args.kubeconfig, args.context)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    namespace = args.namespace or credentials.namespace or "default"
    try:
        obj = json.loads(
            ApiServer(credentials).call_sync(
                "get_rljob", "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{args.name}"
            )
        )
    except ApiError as err:
        print(f"error: rljob {namespace}/{args.name}: {err.reason}", file=sys.stderr)
        return 1
    status = parse_status(obj.get("status"))
    if args.command == "profile":
        sys.stdout.write(terminal_chart(status))
        if args.html:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(html_report(args.name, namespace, status))
            print(f"wrote {args.html}")
        return 0
    sys.stdout.write(render(args.name, namespace, status, obj.get("spec", {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
