"""The emulator held to the real engine: the same HTTP sequences sent to a server, and what it answered, step
by step, in a form two servers' answers compare in: status, content type, the body's fields (its key tree),
chosen values, a timing class, and the server's state after the sequence. What differs per engine (the
stated state, the values compared by default, how the state after is read) is an `Engine`: SGLANG here,
rljob.testing.vllm_differential.VLLM for vLLM.

A sequence is a tests/replays-style list of steps (client_replay's format: method, path, body, headers,
background/join, sleep_s, only_versions) with, per step, optionally:
- `compare`: value paths whose values must match (default: the engine's, DEFAULT_COMPARE for SGLang, where
  present; `a[0].b` reads a list element);
- `timing`: false to leave the timing class out (a long generation's speed is the model's, not SGLang's);
- `fields`: false to leave the key tree out (e.g. /server_info, whose hundreds of arguments differ);
- `volatile_fields`: key paths (and what lies under them) left out of the key tree, where their presence
  depends on timing no sequence controls (which of several identical prompts in flight hits the cache).
A sequence with `"fatal": true` is expected to end the server and runs last.

Each sequence starts from a stated server state (RESET, sent before it and not observed): the launch
weights served as version "0", generation running, the cache flushed; so what a sequence sees does not
depend on the sequences or tests before it. A replay runs on a server launched as its client launches
SGLang: with or without --enable-memory-saver (`load_sequences`, `without_memory_saver`).

tests/gpu/test_real_sglang.py records real SGLang's answers (`observe`), committed as
tests/differential/real-<version>.json; tests/agent/test_differential.py sends the same sequences to the
emulator and compares (`differences`). vLLM's: tests/gpu/test_real_vllm.py, tests/differential/vllm/,
tests/agent/test_vllm_differential.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rljob.testing.client_replay import Answer, Context, send

DEFAULT_COMPARE = (
    "success",
    "status",
    "message",
    "weight_version",
    "num_paused_requests",
    "meta_info.finish_reason.type",
    "meta_info.weight_version",
)
AT_ONCE_S = 0.5  # answered within this: "at once"
SLEEP_MAX_S = 2.5  # a fixed sleep of SGLang's (the 1 s abort loop, /health's 1 s poll) stays under this
STEP_TIMEOUT_S = 60.0
# A server that dropped a connection may be dying: real SGLang sleeps 5 s before its crash diagnostics and
# exits after them (C-MEM-RESUME-OOM), so whether it is alive is asked again until this has passed.
DYING_GRACE_S = 20.0
FIELD_DEPTH = 3


@dataclass(frozen=True)
class Engine:
    """What the runner does differently per engine."""

    name: str  # as differences name the real server: "SGLang", "vLLM"
    reset: tuple[dict[str, Any], ...]  # the steps to the stated state (each may have only_versions)
    reset_state: str  # the stated state, in words
    default_compare: tuple[str, ...]  # the value paths compared where a step names none
    # What a client sees after a sequence: (url, the sequence's Context, version) -> state.
    state_of: Callable[[str, Context, str], dict[str, Any]]


@dataclass
class StepObservation:
    label: str
    status: int
    content_type: str
    fields: list[str] | None
    values: dict[str, Any]
    timing: str | None
    seconds: float
    error: str = ""
    text: str = ""  # the first 300 characters of a body that is not JSON (not compared)


@dataclass
class SequenceObservation:
    name: str
    steps: list[StepObservation] = field(default_factory=list)
    alive_after: bool = True
    state_after: dict[str, Any] = field(default_factory=dict)


def key_tree(doc: Any, prefix: str = "", depth: int = FIELD_DEPTH) -> list[str]:
    """The body's field paths: dict keys to `depth` levels, a list's first element as `[*]`."""
    if depth == 0:
        return []
    out: list[str] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            out.append(path)
            out += key_tree(v, path, depth - 1)
    elif isinstance(doc, list) and doc and isinstance(doc[0], dict | list):
        out += key_tree(doc[0], prefix + "[*]", depth)
    return sorted(out)


def value_at(doc: Any, path: str) -> tuple[bool, Any]:
    """The value at a dotted path; a part `name[i]` takes the list element i (`choices[0].finish_reason`)."""
    for part in path.split("."):
        name, _, index = part.partition("[")
        if not isinstance(doc, dict) or name not in doc:
            return False, None
        doc = doc[name]
        if index:
            i = int(index.rstrip("]"))
            if not isinstance(doc, list) or not -len(doc) <= i < len(doc):
                return False, None
            doc = doc[i]
    return True, doc


def timing_class(seconds: float, released_by_later_step: bool) -> str:
    if released_by_later_step:
        return "waits"
    if seconds < AT_ONCE_S:
        return "at once"
    return "sleeps" if seconds < SLEEP_MAX_S else "slow"


def observe_answer(
    label: str,
    step: dict[str, Any],
    answer: Answer,
    seconds: float,
    waits: bool,
    default_compare: tuple[str, ...] = DEFAULT_COMPARE,
) -> StepObservation:
    try:
        doc = answer.json() if answer.text else None
    except ValueError:
        doc = None
    values: dict[str, Any] = {}
    for path in step.get("compare", default_compare):
        found, value = value_at(doc, path)
        if found:
            values[path] = value
    return StepObservation(
        label=label,
        status=answer.status,
        content_type=answer.content_type.split(";")[0].strip(),
        fields=_stable_keys(key_tree(doc), step.get("volatile_fields", ()))
        if step.get("fields", True) and isinstance(doc, dict | list)
        else None,
        values=values,
        timing=timing_class(seconds, waits) if step.get("timing", True) else None,
        seconds=round(seconds, 4),
        error=answer.error,
        text=answer.text[:300] if doc is None else "",
    )


def _stable_keys(keys: list[str], volatile: list[str] | tuple[str, ...]) -> list[str]:
    return [k for k in keys if not any(k == v or k.startswith(v + ".") for v in volatile)]


def step_label(i: int, step: dict[str, Any]) -> str:
    return f"{i:02d} {step['method']} {step['path']}" + (f" ({step['name']})" if step.get("name") else "")


@dataclass
class _Background:
    label: str
    step: dict[str, Any]
    started: float
    thread: threading.Thread
    result: list[tuple[Answer, float]] = field(default_factory=list)
    next_foreground_sent: float | None = None  # when the first foreground step after it was sent


def observe(
    url: str,
    sequence: dict[str, Any],
    ctx: Context,
    version: str,
    alive: Callable[[], bool],
    engine: Engine | None = None,
) -> SequenceObservation:
    """Sends `sequence`'s steps to the server at `url` and records what it answered."""
    engine = engine or SGLANG
    obs = SequenceObservation(sequence["name"])
    pending: list[_Background] = []
    for i, step in enumerate(sequence["steps"]):
        if version not in step.get("only_versions", [version]):
            continue
        if step.get("join"):
            _join(pending, obs, engine.default_compare)
            continue
        if not alive():
            break
        time.sleep(step.get("sleep_s", 0))
        label = step_label(i, step)
        if step.get("background"):
            pending.append(_start(url, label, step, ctx))
            continue
        sent = time.monotonic()
        for bg in pending:
            if bg.next_foreground_sent is None:
                bg.next_foreground_sent = sent
        answer, seconds = _send(url, step, ctx)
        obs.steps.append(observe_answer(label, step, answer, seconds, False, engine.default_compare))
    _join(pending, obs, engine.default_compare)
    for st in obs.steps:  # a message naming a file of this run's (a missing checkpoint) names it alike
        st.values = {
            k: v.replace(str(ctx.tmp), "{{TMP}}") if isinstance(v, str) else v for k, v in st.values.items()
        }
    obs.alive_after = _still_alive(alive, dropped=any(st.status == 0 for st in obs.steps))
    if obs.alive_after:
        obs.state_after = engine.state_of(url, ctx, version)
    return obs


def _still_alive(alive: Callable[[], bool], dropped: bool) -> bool:
    """Whether the server is alive; after a dropped connection, still alive DYING_GRACE_S later."""
    deadline = time.monotonic() + (DYING_GRACE_S if dropped else 0)
    while alive():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.25)
    return False


def state_of(url: str) -> dict[str, Any]:
    """What a client sees afterwards: the served weight_version, whether a 1-token generate answers."""
    info = send(url, "GET", "/model_info", {}, None, timeout=15)
    gen = send(
        url,
        "POST",
        "/generate",
        {"Content-Type": "application/json"},
        b'{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}',
        timeout=30,
    )
    found, version = value_at(_json(info), "weight_version")
    return {"weight_version": version if found else None, "generate_status": gen.status}


def _json(answer: Answer) -> Any:
    try:
        return answer.json()
    except ValueError:
        return None


def _send(url: str, step: dict[str, Any], ctx: Context) -> tuple[Answer, float]:
    body = step.get("body")
    data = ctx.fill(body).encode() if body is not None else None
    started = time.monotonic()
    answer = send(url, step["method"], ctx.fill(step["path"]), step.get("headers", {}), data, STEP_TIMEOUT_S)
    return answer, time.monotonic() - started


def _start(url: str, label: str, step: dict[str, Any], ctx: Context) -> _Background:
    bg = _Background(label, step, time.monotonic(), threading.Thread(daemon=True))
    bg.thread = threading.Thread(target=lambda: bg.result.append(_send(url, step, ctx)), daemon=True)
    bg.thread.start()
    return bg


def _join(
    pending: list[_Background], obs: SequenceObservation, default_compare: tuple[str, ...] = DEFAULT_COMPARE
) -> None:
    for bg in pending:
        bg.thread.join(STEP_TIMEOUT_S)
        if not bg.result:
            obs.steps.append(StepObservation(bg.label, 0, "", None, {}, None, STEP_TIMEOUT_S, "no answer"))
            continue
        answer, seconds = bg.result[0]
        # It waited on a later step when it was still unanswered as the next foreground step went out (that
        # step ended or released it) and took longer than an answer at once.
        ended = bg.started + seconds
        waits = (
            bg.next_foreground_sent is not None and ended > bg.next_foreground_sent and seconds >= AT_ONCE_S
        )
        obs.steps.append(observe_answer(bg.label, bg.step, answer, seconds, waits, default_compare))
    pending.clear()


# --- comparing -----------------------------------------------------------------------------------------


def differences(real: dict[str, Any], emulated: dict[str, Any], engine: str = "SGLang") -> list[str]:
    """Each way the emulator's observation of a sequence differs from the real engine's (`engine` names
    it), as `what: real X, emulator Y` lines keyed by the step label."""
    out: list[str] = []
    r_steps = {s["label"]: s for s in real["steps"]}
    e_steps = {s["label"]: s for s in emulated["steps"]}
    for label in sorted(set(r_steps) | set(e_steps)):
        r, e = r_steps.get(label), e_steps.get(label)
        if r is None or e is None:
            out.append(f"{label}: sent to {'the emulator' if r is None else 'real ' + engine} only")
            continue
        for key in ("status", "content_type", "timing"):
            if r[key] is not None and e[key] is not None and r[key] != e[key]:
                out.append(f"{label}: {key} real {r[key]!r}, emulator {e[key]!r}")
        if r["fields"] is not None and e["fields"] is not None and r["fields"] != e["fields"]:
            only_r = sorted(set(r["fields"]) - set(e["fields"]))
            only_e = sorted(set(e["fields"]) - set(r["fields"]))
            out.append(f"{label}: fields only real {only_r}, only emulator {only_e}")
        for path in sorted(set(r["values"]) | set(e["values"])):
            rv, ev = r["values"].get(path, "<absent>"), e["values"].get(path, "<absent>")
            if rv != ev:
                out.append(f"{label}: {path} real {rv!r:.160}, emulator {ev!r:.160}")
    if real["alive_after"] != emulated["alive_after"]:
        out.append(f"after: alive real {real['alive_after']}, emulator {emulated['alive_after']}")
    for key in sorted(set(real["state_after"]) | set(emulated["state_after"])):
        rv, ev = real["state_after"].get(key), emulated["state_after"].get(key)
        if rv != ev:
            out.append(f"after: {key} real {rv!r}, emulator {ev!r}")
    return out


def as_dict(obs: SequenceObservation) -> dict[str, Any]:
    return asdict(obs)


# --- the whole run -------------------------------------------------------------------------------------


MEMORY_SAVER = "--enable-memory-saver"
# The stated state every sequence starts from: the launch weights as version "0" (the load flushes the
# cache), generation running. Needs a server that serves with every tag resident, as every sequence but a
# fatal one leaves it.
_JSON = {"Content-Type": "application/json"}
RESET = (
    {"method": "POST", "path": "/continue_generation", "headers": _JSON, "body": "{}"},
    {
        "method": "POST",
        "path": "/update_weights_from_disk",
        "headers": _JSON,
        "body": '{"model_path": "{{LAUNCH_MODEL_PATH}}", "weight_version": "0"}',
    },
)
# Where a hit was cached (GPU or host): present or not by which of several prompts in flight hit the cache.
CACHE_SPLIT = ("meta_info.cached_tokens_details.device", "meta_info.cached_tokens_details.host")
RESET_STATE = 'the launch weights as weight_version "0", generation running, the cache flushed'


def _sglang_state_of(url: str, ctx: Context, version: str) -> dict[str, Any]:
    return state_of(url)


SGLANG = Engine("SGLang", RESET, RESET_STATE, DEFAULT_COMPARE, _sglang_state_of)


def without_memory_saver(launch_flags: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The launch of a client that runs SGLang without the memory saver (AReaL's default): the same flags
    less --enable-memory-saver."""
    return tuple(f for f in launch_flags if f != MEMORY_SAVER)


def load_sequences(
    sequences_file: Path,
    replays_dir: Path,
    launch_flags: list[str] | tuple[str, ...],
    own_sequences: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The differential sequences (unless `own_sequences` is false), then every replay (named
    `replay:<file stem>`) whose client launches SGLang with the memory saver as the server under test was
    launched, or without it as it was not, the fatal ones last; and the replays left out, with why
    (without the saver a release frees nothing, and a refit of released weights writes to unmapped
    memory)."""
    doc = json.loads(sequences_file.read_text())
    own = [{**seq, "placeholders": doc.get("placeholders", {})} for seq in doc["sequences"]]
    if not own_sequences:
        own = []
    replays, left_out = [], {}
    saver = MEMORY_SAVER in launch_flags
    for p in sorted(replays_dir.glob("*.json")):
        seq = {**json.loads(p.read_text()), "name": f"replay:{p.stem}"}
        if (MEMORY_SAVER in seq.get("emulator_args", [])) != saver:
            how = "without" if saver else "with"
            left_out[seq["name"]] = f"its client launches SGLang {how} {MEMORY_SAVER}"
            continue
        for step in seq["steps"]:  # identical prompts in flight: which one hits the cache is timing's
            if step.get("background") and step.get("path") == "/generate":
                step.setdefault("volatile_fields", list(CACHE_SPLIT))
        replays.append(seq)
    ordered = own + replays
    return [s for s in ordered if not s.get("fatal")] + [s for s in ordered if s.get("fatal")], left_out


def contexts(
    tmp: Path, launch: Path, builders: dict[str, Callable[[], str]] | None = None
) -> Callable[[str], Context]:
    """Per sequence a Context whose WEIGHTS_DIR is a TinyLlama checkpoint of the launch model's shapes
    (other weights), MISSING_PATH a path that is not there, LAUNCH_MODEL_PATH the launch checkpoint; the
    tensor placeholders are the stand-ins unless `builders` replaces them."""
    from rljob.testing.tiny_model import TinyLlama

    weights = TinyLlama().write(tmp / "weights-7", seed=7)

    def make(name: str) -> Context:
        values = {
            "WEIGHTS_DIR": str(weights),
            "MISSING_PATH": str(tmp / "no-such-checkpoint"),
            "LAUNCH_MODEL_PATH": str(launch),
        }
        d = tmp / name.replace(":", "-")
        d.mkdir(parents=True, exist_ok=True)
        return Context(d, values, dict(builders or {}))

    return make


def run_all(
    url: str,
    alive: Callable[[], bool],
    sequences: list[dict[str, Any]],
    version: str,
    context: Callable[[str], Context],
    reset: bool = False,
    engine: Engine | None = None,
) -> list[dict[str, Any]]:
    """Each sequence in order, each with a fresh Context from `context(name)`, with `reset` from the
    engine's stated state (SGLang's: RESET); stops after the server died."""
    out = []
    for seq in sequences:
        ctx = context(seq["name"])
        ctx.build_all(seq)
        if reset:
            reset_server(url, ctx, version, engine)
        out.append(as_dict(observe(url, seq, ctx, version, alive, engine)))
        if not alive():
            break
    return out


def reset_server(url: str, ctx: Context, version: str | None = None, engine: Engine | None = None) -> None:
    """The engine's reset steps (those of `version`); each must succeed, or no sequence can start from the
    stated state."""
    engine = engine or SGLANG
    for step in engine.reset:
        if version is not None and version not in step.get("only_versions", [version]):
            continue
        answer, _ = _send(url, dict(step), ctx)
        if answer.status != 200 or '"success":false' in answer.text.replace(" ", ""):
            raise AssertionError(
                f"reset {step['path']}: {answer.status} {answer.text[:300]} {answer.error}: the server "
                f"is not in a state a sequence can start from ({engine.reset_state})"
            )


def table(
    real: list[dict[str, Any]],
    emulated: list[dict[str, Any]],
    recorded: dict[str, str],
    engine: str = "SGLang",
) -> str:
    """Markdown: one row per sequence, then each difference with the conformance row that records it
    (`recorded`: "<sequence>: <difference>" -> row), or NOT RECORDED."""
    by_name = {o["name"]: o for o in emulated}
    lines = [
        "| sequence | steps | real alive after | emulator alive after | differences |",
        "|---|---:|---|---|---|",
    ]
    notes = []
    for r in real:
        name = r["name"]
        e = by_name.get(name)
        diffs = differences(r, e, engine) if e is not None else ["not run on the emulator"]
        alive_e = e["alive_after"] if e is not None else "-"
        lines.append(f"| {name} | {len(r['steps'])} | {r['alive_after']} | {alive_e} | {len(diffs)} |")
        for d in diffs:
            notes.append(f"- {name}: {d} — {recorded.get(f'{name}: {d}', 'NOT RECORDED')}")
    return "\n".join([*lines, "", *notes]) + "\n"


def recorded(known_file: Path) -> dict[str, str]:
    """`"<sequence>: <difference>" -> where it is recorded` from a known-differences file, {} without one."""
    if not known_file.exists():
        return {}
    return {
        f"{d['sequence']}: {d['difference']}": d["recorded"]
        for d in json.loads(known_file.read_text())["differences"]
    }
