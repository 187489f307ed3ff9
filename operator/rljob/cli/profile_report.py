"""`kubectl rljob profile NAME [--html FILE]`: the per-iteration profile (status.iterationHistory) as a
terminal chart, and as one self-contained HTML file with inline SVG plots (no script, no network): the
phase stack per iteration, GPU busy and prefix reuse, tokens/s against the decode roofline, requests
running and waiting, and the diagnosis. docs/profiling.md defines every number; a signal that was not
measured reads "not measured" (the terminal: "n/m"), with its reason, never 0 or a blank."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from rljob.api.status import IterationReport, Lever, RLJobStatus, Signal, Unmeasured
from rljob.lifecycle.signals import SIGNAL_LABELS

# (field of PhaseSeconds, label, terminal glyph, colour): the phase stack's order and legend.
PHASES: tuple[tuple[str, str, str, str], ...] = (
    ("rollout", "rollout", "R", "#2b8cbe"),
    ("draining", "drain", "D", "#fdae6b"),
    ("releasing", "release", "L", "#e6550d"),
    ("training", "train", "T", "#31a354"),
    ("refitting", "refit", "F", "#756bb1"),
    ("resuming", "resume", "S", "#bcbddc"),
)
OVERHEAD_COLOUR = "#636363"
NOT_MEASURED = "not measured"
NOT_MEASURED_SHORT = "n/m"  # the terminal chart's narrow columns


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _wall(r: IterationReport) -> float:
    return r.wall_seconds if r.wall_seconds is not None else sum(getattr(r.seconds, f) for f, *_ in PHASES)


def unmeasured_in(r: IterationReport | None, *signals: Signal) -> Unmeasured | None:
    """The first of `signals` that `r` lists as not measured (a figure derived from it is not either)."""
    if r is None:
        return None
    return next((e for e in r.unmeasured if e.signal in signals), None)


def not_measured_lines(entries: Sequence[Unmeasured], prefix: str = "  Not measured: ") -> list[str]:
    """One line per reason: `Not measured: prefix-cache hit rate, token counts (MetricsDisabled: why)`."""
    groups: dict[tuple[str, str], list[str]] = {}
    for e in entries:
        groups.setdefault((e.reason.value, e.message), []).append(SIGNAL_LABELS[e.signal])
    return [
        f"{prefix}{', '.join(labels)} ({reason}{': ' + message if message else ''})"
        for (reason, message), labels in groups.items()
    ]


def history(status: RLJobStatus) -> list[IterationReport]:
    """The reports to chart: the bounded history, or the last iteration of an older status."""
    if status.iteration_history:
        return list(status.iteration_history)
    return [status.last_iteration] if status.last_iteration else []


# --- terminal ---------------------------------------------------------------------------------------


def stack_bar(r: IterationReport, seconds_per_char: float) -> str:
    """One glyph per `seconds_per_char` of wall time, phase by phase; boundaries fall where the running
    total rounds, so the bar's length is the iteration's wall time and a phase shorter than half a
    character may not show."""
    out, total = [], 0.0
    for field, _, glyph, _ in PHASES:
        start = round(total / seconds_per_char)
        total += getattr(r.seconds, field)
        out.append(glyph * (round(total / seconds_per_char) - start))
    return "".join(out)


def diagnosis_lines(levers: Sequence[Lever]) -> list[str]:
    if not levers:
        return ["  no lever stands out"]
    lines = []
    for n, lever in enumerate(levers, 1):
        share = f" ({lever.share:.0%} of the iteration)" if lever.share else ""
        lines.append(f"  {n}. {lever.lever.value}{share}: {lever.reason}")
        if lever.evidence:
            lines.append(f"     measured: {lever.evidence}")
    return lines


def engines(status: RLJobStatus) -> str | None:
    """The engine (and version) the pods report, e.g. `<label> <version>`; several where they differ."""
    found = sorted({p.engine for p in status.pods if p.engine})
    return ", ".join(found) if found else None


def terminal_chart(status: RLJobStatus, width: int = 48) -> str:
    reports = history(status)
    if not reports:
        return "No completed iteration yet: the profile appears after the first one.\n"
    longest = max(_wall(r) for r in reports) or 1.0
    scale = longest / width
    legend = "  ".join(f"{glyph} {label}" for _, label, glyph, _ in PHASES)
    header = ["ITER", "WALL", f"PHASES (1 char = {scale:.3g}s)".ljust(width), "ROLLOUT%", "GPU-BUSY"]
    header += ["CACHE-HIT", "RUN/WAIT", "TOK/S", "ROOFLINE", "GPU-s/SAMPLE"]

    def cell(r: IterationReport, text: str, *signals: Signal) -> str:
        return NOT_MEASURED_SHORT if unmeasured_in(r, *signals) else text

    tps = Signal.GENERATION_TOKENS_PER_SECOND
    rows = [
        [
            str(r.iteration),
            f"{_wall(r):.2f}s",
            stack_bar(r, scale).ljust(width),
            _pct(r.rollout_share),
            cell(r, _pct(r.gpu_busy_fraction), Signal.GPU_BUSY_FRACTION),
            cell(r, _pct(r.cache_hit_rate), Signal.CACHE_HIT_RATE),
            f"{_num(r.mean_running_requests, '.1f')}/{_num(r.mean_waiting_requests, '.1f')}",
            cell(r, _num(r.generation_tokens_per_second), tps),
            cell(r, _pct(r.roofline_fraction), tps),
            cell(r, _num(r.gpu_seconds_per_sample, ".3g"), Signal.SAMPLES),
        ]
        for r in reports
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    ]
    on = f" on {engines(status)}" if engines(status) else ""
    out = [f"Per-iteration profile ({len(reports)} iterations{on})", *lines, f"  {legend}"]
    out += not_measured_lines(reports[-1].unmeasured, prefix=f"  {NOT_MEASURED_SHORT}, not measured: ")
    out.append("")
    out += ["Levers (last iteration):", *diagnosis_lines(status.diagnosis)]
    return "\n".join(out) + "\n"


# --- HTML ------------------------------------------------------------------------------------------

CHART_W, CHART_H = 560, 220
PAD_L, PAD_R, PAD_T, PAD_B = 56, 16, 16, 36


def _svg(body: list[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" '
        f'viewBox="0 0 {CHART_W} {CHART_H}" role="img" aria-label="{html.escape(title)}">'
        + "".join(body)
        + "</svg>"
    )


def nice_top(value: float) -> float:
    """The axis top: the smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k at or above `value`
    (grid lines at quarters of it)."""
    if value <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(value))
    return next(
        m * magnitude for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * magnitude >= value * 0.999
    )


def si(value: float) -> str:
    """Axis labels that fit: 1.5k, 2M, 0.25."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _frame(
    reports: Sequence[IterationReport], top: float, label: Callable[[float], str]
) -> tuple[list[str], Callable[[int], float], float, Callable[[float], float]]:
    """Axes for one bar per iteration: (elements, x of bar i, bar width, y of a value)."""
    plot_w, plot_h = CHART_W - PAD_L - PAD_R, CHART_H - PAD_T - PAD_B
    slot = plot_w / max(1, len(reports))
    bar = max(2.0, slot * 0.7)

    def x(i: int) -> float:
        return PAD_L + i * slot + (slot - bar) / 2

    def y(v: float) -> float:
        return PAD_T + plot_h - (v / top if top > 0 else 0) * plot_h

    els = []
    for k in range(5):  # horizontal grid with labels
        v = top * k / 4
        els.append(
            f'<line x1="{PAD_L}" x2="{CHART_W - PAD_R}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
        )
        els.append(
            f'<text x="{PAD_L - 6}" y="{y(v) + 4:.1f}" class="axis" text-anchor="end">{label(v)}</text>'
        )
    step = max(1, len(reports) // 12)
    for i, r in enumerate(reports):
        if i % step == 0 or i == len(reports) - 1:
            els.append(
                f'<text x="{x(i) + bar / 2:.1f}" y="{CHART_H - PAD_B + 16}" class="axis" '
                f'text-anchor="middle">{r.iteration}</text>'
            )
    els.append(
        f'<text x="{PAD_L + plot_w / 2:.1f}" y="{CHART_H - 4}" class="axis" '
        'text-anchor="middle">iteration</text>'
    )
    return els, x, bar, y


def _rect(x: float, y: float, w: float, h: float, colour: str, tip: str) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{max(0.0, h):.1f}" fill="{colour}">'
        f"<title>{html.escape(tip)}</title></rect>"
    )


def _polyline(points: list[tuple[float, float]], colour: str, dash: bool = False) -> str:
    if not points:
        return ""
    style = ' stroke-dasharray="5 3"' if dash else ""
    pts = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    dots = "".join(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in points)
    return f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="2"{style}/>{dots}'


def phase_stack_svg(reports: Sequence[IterationReport]) -> str:
    top = nice_top(max(_wall(r) for r in reports))
    els, x, bar, y = _frame(reports, top, lambda v: f"{si(v)}s")
    for i, r in enumerate(reports):
        base = 0.0
        for field, label, _, colour in PHASES:
            secs = getattr(r.seconds, field)
            if secs > 0:
                els.append(
                    _rect(
                        x(i),
                        y(base + secs),
                        bar,
                        y(base) - y(base + secs),
                        colour,
                        f"{r.iteration} {label} {secs:.3f}s",
                    )
                )
            base += secs
        overhead = min(r.control_overhead_seconds, base)
        if overhead > 0:  # inside the command phases: drawn as a thin strip beside the bar
            els.append(
                _rect(
                    x(i) + bar,
                    y(overhead),
                    3,
                    y(0) - y(overhead),
                    OVERHEAD_COLOUR,
                    f"control overhead {overhead:.3f}s",
                )
            )
    return _svg(els, "phase stack per iteration")


def busy_svg(reports: Sequence[IterationReport]) -> str:
    els, x, bar, y = _frame(reports, 1.0, lambda v: f"{v:.0%}")
    for i, r in enumerate(reports):
        if r.gpu_busy_fraction is not None:
            v = r.gpu_busy_fraction
            els.append(_rect(x(i), y(v), bar, y(0) - y(v), "#e6550d", f"{r.iteration}: GPU busy {v:.0%}"))
    hits = [
        (x(i) + bar / 2, y(r.cache_hit_rate)) for i, r in enumerate(reports) if r.cache_hit_rate is not None
    ]
    shares = [
        (x(i) + bar / 2, y(r.rollout_share)) for i, r in enumerate(reports) if r.rollout_share is not None
    ]
    els.append(_polyline(hits, "#2b8cbe"))
    els.append(_polyline(shares, "#31a354", dash=True))
    return _svg(els, "GPU busy during rollout, prefix-cache hit rate and rollout share")


def throughput_svg(reports: Sequence[IterationReport]) -> str:
    values = [
        v for r in reports for v in (r.generation_tokens_per_second, r.decode_roofline_tokens_per_second) if v
    ]
    top = nice_top(max([*values, 1.0]))
    els, x, bar, y = _frame(reports, top, si)
    for i, r in enumerate(reports):
        if r.generation_tokens_per_second is not None:
            v = r.generation_tokens_per_second
            els.append(_rect(x(i), y(v), bar, y(0) - y(v), "#2b8cbe", f"{r.iteration}: {v:.0f} tok/s"))
    roof = [
        (x(i) + bar / 2, y(r.decode_roofline_tokens_per_second))
        for i, r in enumerate(reports)
        if r.decode_roofline_tokens_per_second is not None
    ]
    els.append(_polyline(roof, "#de2d26", dash=True))
    return _svg(els, "generation tokens per second against the decode roofline")


def requests_svg(reports: Sequence[IterationReport]) -> str:
    values = [(r.mean_running_requests or 0) + (r.mean_waiting_requests or 0) for r in reports]
    top = nice_top(max([*values, 1.0]))
    els, x, bar, y = _frame(reports, top, si)
    for i, r in enumerate(reports):
        run, wait = r.mean_running_requests, r.mean_waiting_requests
        if run is not None:
            els.append(
                _rect(x(i), y(run), bar, y(0) - y(run), "#756bb1", f"{r.iteration}: {run:.1f} running")
            )
        if wait:
            base = run or 0.0
            els.append(
                _rect(x(i), y(base + wait), bar, y(base) - y(base + wait), "#fdae6b", f"{wait:.1f} waiting")
            )
    return _svg(els, "mean running and waiting requests during rollout")


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><i style="background:{c}"></i>{html.escape(label)}</span>' for label, c in items)
        + "</div>"
    )


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;max-width:1180px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:0 0 6px}
.sub{color:#666;margin-bottom:18px}
.grid2{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:18px}
.card{border:1px solid #ddd;border-radius:6px;padding:12px 14px;background:#fff}
.grid{stroke:#eee;stroke-width:1} .axis{font-size:11px;fill:#666}
.legend{font-size:12px;color:#444;margin-top:4px} .legend span{margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
table{border-collapse:collapse;font-size:12px;width:100%}
th,td{padding:3px 6px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left} th{color:#555;font-weight:600}
ol.levers{margin:0;padding-left:20px} ol.levers li{margin-bottom:8px}
.lever{font-weight:600} .ev{color:#555;font-size:12px}
td.nm{color:#999;font-style:italic} ul.nm-list{margin:0;padding-left:20px}
"""


def _signals_table(reports: Sequence[IterationReport]) -> str:
    tps, tokens = Signal.GENERATION_TOKENS_PER_SECOND, Signal.TOKEN_COUNTS
    # (heading, the cell's text, the signals it is derived from)
    cols: list[tuple[str, Callable[[IterationReport], str], tuple[Signal, ...]]] = [
        ("iter", lambda r: str(r.iteration), ()),
        ("wall", lambda r: f"{_wall(r):.2f}s", ()),
        ("rollout %", lambda r: _pct(r.rollout_share), ()),
        ("GPU busy", lambda r: _pct(r.gpu_busy_fraction), (Signal.GPU_BUSY_FRACTION,)),
        ("cache hit", lambda r: _pct(r.cache_hit_rate), (Signal.CACHE_HIT_RATE,)),
        ("running", lambda r: _num(r.mean_running_requests, ".1f"), ()),
        ("waiting", lambda r: _num(r.mean_waiting_requests, ".1f"), ()),
        ("tok/s", lambda r: _num(r.generation_tokens_per_second), (tps,)),
        ("tok/s/GPU", lambda r: _num(r.tokens_per_second_per_gpu), (tps,)),
        ("roofline", lambda r: _pct(r.roofline_fraction), (tps,)),
        ("samples", lambda r: _num(r.samples, "d") if r.samples is not None else "-", (Signal.SAMPLES,)),
        ("GPU-s/sample", lambda r: _num(r.gpu_seconds_per_sample, ".3g"), (Signal.SAMPLES,)),
        ("tok/GPU-s", lambda r: _num(r.tokens_per_gpu_second), (tokens,)),
        ("overhead", lambda r: f"{r.control_overhead_seconds:.3f}s", ()),
    ]

    def td(r: IterationReport, text: Callable[[IterationReport], str], derived: tuple[Signal, ...]) -> str:
        missing = unmeasured_in(r, *derived)
        if missing is None:
            return f"<td>{html.escape(text(r))}</td>"
        why = f"{missing.reason.value}: {missing.message}" if missing.message else missing.reason.value
        return f'<td class="nm" title="{html.escape(why)}">{NOT_MEASURED}</td>'

    head = "".join(f"<th>{html.escape(c)}</th>" for c, _, _ in cols)
    body = "".join("<tr>" + "".join(td(r, f, d) for _, f, d in cols) + "</tr>" for r in reports)
    return f"<table><tr>{head}</tr>{body}</table>"


def _unmeasured_html(entries: Sequence[Unmeasured]) -> str:
    items = "".join(f"<li>{html.escape(line)}</li>" for line in not_measured_lines(entries, prefix=""))
    return f'<ul class="nm-list">{items}</ul>'


def _levers_html(levers: Sequence[Lever]) -> str:
    if not levers:
        return "<p>No lever stands out.</p>"
    items = []
    for lever in levers:
        share = f" — {lever.share:.0%} of the iteration" if lever.share else ""
        ev = f'<div class="ev">measured: {html.escape(lever.evidence)}</div>' if lever.evidence else ""
        items.append(
            f'<li><span class="lever">{html.escape(lever.lever.value)}</span>{share}: '
            f"{html.escape(lever.reason)}{ev}</li>"
        )
    return '<ol class="levers">' + "".join(items) + "</ol>"


def html_report(name: str, namespace: str, status: RLJobStatus) -> str:
    reports = history(status)
    verdict = status.profile.verdict.value if status.profile else "-"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>RLJob {html.escape(namespace)}/{html.escape(name)}: rollout profile</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>RLJob {html.escape(namespace)}/{html.escape(name)}: rollout profile</h1>",
        f'<div class="sub">phase {html.escape(status.phase.value)}, iteration {status.iteration}, weights '
        f"{html.escape(status.weight_version or '-')}, engine {html.escape(engines(status) or '-')}, verdict "
        f"{html.escape(verdict)}; {len(reports)} completed iterations shown</div>",
    ]
    if not reports:
        parts.append(
            "<p>No completed iteration yet: the profile appears after the first one.</p></body></html>"
        )
        return "\n".join(parts)
    parts += [
        '<div class="card" style="margin-bottom:18px"><h2>Levers, largest share first</h2>',
        _levers_html(status.diagnosis),
        "</div>",
    ]
    if reports[-1].unmeasured:
        parts += [
            '<div class="card" style="margin-bottom:18px"><h2>Not measured in the last iteration, so not '
            "judged</h2>",
            _unmeasured_html(reports[-1].unmeasured),
            "</div>",
        ]
    parts += [
        '<div class="grid2">',
        '<div class="card"><h2>Where the wall-clock went, per iteration</h2>',
        phase_stack_svg(reports),
        _legend([(label, c) for _, label, _, c in PHASES] + [("control overhead", OVERHEAD_COLOUR)]),
        "</div>",
        '<div class="card"><h2>GPU busy during rollout, prefix reuse</h2>',
        busy_svg(reports),
        _legend(
            [
                ("GPU busy (NVML)", "#e6550d"),
                ("prefix-cache hit rate", "#2b8cbe"),
                ("rollout share", "#31a354"),
            ]
        ),
        "</div>",
        '<div class="card"><h2>Generation tokens/s against the decode roofline</h2>',
        throughput_svg(reports),
        _legend([("tokens/s (gang)", "#2b8cbe"), ("decode roofline at the measured batch", "#de2d26")]),
        "</div>",
        '<div class="card"><h2>Requests in the engine during rollout (mean)</h2>',
        requests_svg(reports),
        _legend([("running", "#756bb1"), ("waiting (queued)", "#fdae6b")]),
        "</div>",
        "</div>",
        '<div class="card" style="margin-top:18px"><h2>Signals per iteration</h2>',
        _signals_table(reports),
        "</div>",
        "</body></html>",
    ]
    return "\n".join(parts)
