"""Replays of real SGLang clients (slime, verl, AReaL, SGLang's own server tests) against the emulator.

Each tests/replays/<name>.json holds one RL iteration's HTTP sequence as the client's code sends it (the
format is described in the file's "format" key; sources and citations are in docs/sglang-conformance.md,
"Real clients replayed"). For each (sequence, version) the emulator is launched with the client's flags,
every step's body is sent as the exact bytes the client's HTTP library writes, with its headers, and the
reply is checked: status, and each field the client reads (present, of the right type). The emulator must
be alive at the end. A step the emulator answers wrongly fails the test with the step's citation."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Emulator, write_weights

from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer import packing
from rljob.trainer.packing import Call, Global, Instance

REPLAYS = Path(__file__).resolve().parents[1] / "replays"
LOCAL_SERIALIZED_TENSOR = Global("sglang.srt.model_executor.model_runner", "LocalSerializedTensor")
STEP_TIMEOUT_S = 60.0
ITEMSIZE = {"bfloat16": 2, "float32": 4}


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def cases() -> Iterator[Any]:
    for path in sorted(REPLAYS.glob("*.json")):
        seq = load(path)
        failing_launch = seq.get("launch_fails_at", {}).get("versions", [])
        for version in seq["versions"]:
            marks = [pytest.mark.emulator_may_die] if version in failing_launch else []
            yield pytest.param(path.name, version, id=f"{path.stem}-{version}", marks=marks)


# --- payloads the clients build with torch + SGLang's MultiprocessingSerializer, written without torch ---


def client_reduction(nbytes: int, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> Call:
    """reduce_tensor of a CUDA tensor with a made-up IPC handle, the device as the UUID SGLang's patched
    reduction sends (patch_torch.py:85-86@0.5.23)."""
    return cuda_reduction(nbytes, dtype=dtype, shape=shape)


def flattened_bucket_b64() -> str:
    """slime: one flattened bucket of two dtypes (bfloat16 [4, 4] at bytes 0-32, float32 [4] at 32-48)."""
    entries = [
        packing.metadata_entry("model.layers.0.mlp.weight", (4, 4), "bfloat16", 0, 32),
        packing.metadata_entry("model.layers.0.mlp.bias", (4,), "float32", 32, 48),
    ]
    return packing.to_wire(packing.bucket_payload(client_reduction(48), entries))


def named_tensors() -> list[tuple[str, Call]]:
    return [
        ("model.layers.0.mlp.weight", client_reduction(32, "bfloat16", (4, 4))),
        ("model.layers.0.mlp.bias", client_reduction(16, "float32", (4,))),
    ]


def local_serialized_named_tensors_b64() -> str:
    """verl (sglang.srt.weight_sync.utils.update_weights@0.5.6): [(name, LocalSerializedTensor(values=[one
    pickled tensor per TP rank]))], pickled, base64."""
    items = [
        (name, Instance(LOCAL_SERIALIZED_TENSOR, {"values": [packing.dumps(reduction)]}))
        for name, reduction in named_tensors()
    ]
    return packing.to_wire(packing.dumps(items))


def named_tensors_b64() -> str:
    """Engine.update_weights_from_tensor: [(name, tensor)] pickled per TP rank, base64."""
    return packing.to_wire(packing.dumps(named_tensors()))


@dataclass
class Context:
    tmp: Path
    values: dict[str, str] = field(default_factory=dict)

    def build(self, name: str, kind: str) -> None:
        builders: dict[str, Callable[[], str]] = {
            "flattened_bucket_b64": flattened_bucket_b64,
            "local_serialized_named_tensors_b64": local_serialized_named_tensors_b64,
            "named_tensors_b64": named_tensors_b64,
            "weights_dir": lambda: str(write_weights(self.tmp / f"ckpt-{name.lower()}", "2").parent),
            "missing_path": lambda: str(self.tmp / "no-such-checkpoint"),
            "launch_model_path": lambda: str(self.tmp / "launch-model"),
        }
        self.values[name] = builders[kind]()

    def fill(self, text: str) -> str:
        for name, value in self.values.items():
            text = text.replace("{{" + name + "}}", value)
        assert "{{" not in text, f"unfilled placeholder in {text[:200]}"
        return text

    def fill_value(self, value: Any) -> Any:
        return self.fill(value) if isinstance(value, str) else value


# --- sending and checking ---------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    content_type: str
    text: str
    error: str = ""

    def json(self) -> Any:
        return json.loads(self.text)


def send(url: str, method: str, path: str, headers: dict[str, str], body: bytes | None) -> Answer:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=STEP_TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheader("Content-Type") or "", resp.read().decode(errors="replace"))
    except OSError as e:
        return Answer(0, "", "", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


TYPES: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, float),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def resolve(doc: Any, path: str) -> list[Any]:
    """The values at `path` (a.b[0][*]); [*] fans out over a list and needs at least one element. Raises
    LookupError naming the first missing part."""
    values = [doc]
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        nxt: list[Any] = []
        for v in values:
            if part == "[*]":
                if not isinstance(v, list) or not v:
                    raise LookupError(f"{part!r} of {path}: not a non-empty list ({type(v).__name__})")
                nxt.extend(v)
            elif part.startswith("["):
                i = int(part[1:-1])
                if not isinstance(v, list) or len(v) <= i:
                    raise LookupError(f"{part!r} of {path}: no element {i}")
                nxt.append(v[i])
            else:
                if not isinstance(v, dict) or part not in v:
                    raise LookupError(f"{part!r} of {path}: missing")
                nxt.append(v[part])
        values = nxt
    return values


def check(step: dict[str, Any], answer: Answer, ctx: Context) -> list[str]:
    expect = step.get("expect", {})
    problems: list[str] = []
    if answer.error:
        return [f"no answer: {answer.error}"]
    if "status" in expect and answer.status != expect["status"]:
        problems.append(f"status {answer.status}, expected {expect['status']}: {answer.text[:300]!r}")
    if "content_type" in expect and answer.content_type.split(";")[0].strip() != expect["content_type"]:
        problems.append(f"Content-Type {answer.content_type!r}, expected {expect['content_type']!r}")
    checks = expect.get("reads", []) or expect.get("equals") or expect.get("not_equals")
    if not checks:
        return problems
    try:
        doc = answer.json()
    except ValueError:
        return problems or [f"reply is not JSON: {answer.text[:300]!r}"]
    for read in expect.get("reads", []):
        try:
            values = resolve(doc, read["path"])
        except LookupError as e:
            problems.append(f"reads {read['path']} ({read['cite']}): {e}")
            continue
        for v in values:
            if not TYPES[read["type"]](v):
                what = f"{type(v).__name__} {v!r:.80}"
                problems.append(f"reads {read['path']} ({read['cite']}): {what}, not {read['type']}")
                break
            if "len" in read and len(v) != read["len"]:
                problems.append(f"reads {read['path']} ({read['cite']}): length {len(v)}, not {read['len']}")
                break
    for path, want in expect.get("equals", {}).items():
        try:
            got = resolve(doc, path)
        except LookupError as e:
            problems.append(f"equals {path}: {e}")
            continue
        if any(g != ctx.fill_value(want) for g in got):
            problems.append(f"{path} = {got!r:.120}, expected {ctx.fill_value(want)!r}")
    for path, unwanted in expect.get("not_equals", {}).items():
        try:
            got = resolve(doc, path)
        except LookupError as e:
            problems.append(f"not_equals {path}: {e}")
            continue
        if any(g == unwanted for g in got):
            problems.append(f"{path} = {unwanted!r}, which the client asserts against")
    return problems


def run_step(emu: Emulator, step: dict[str, Any], ctx: Context) -> tuple[Answer, list[str]]:
    body = step.get("body")
    data = ctx.fill(body).encode() if body is not None else None
    path = ctx.fill(step["path"])
    retry = step.get("retry")
    attempts = retry["max_attempts"] if retry else 1
    for attempt in range(attempts):
        answer = send(emu.url, step["method"], path, step.get("headers", {}), data)
        if not retry or answer.status == retry["until_status"] or attempt == attempts - 1:
            break
        time.sleep(retry["interval_s"])
    return answer, check(step, answer, ctx)


def label(i: int, step: dict[str, Any]) -> str:
    wire = step.get("wire", "http")
    return f"step {i} {step['method']} {step['path']} ({step['name']}; {wire}; {step['cite']})"


@dataclass
class Replay:
    """Sends a sequence's steps in order; background steps run in threads until the next join step."""

    emu: Emulator
    ctx: Context
    version: str
    failures: list[str] = field(default_factory=list)
    pending: list[tuple[str, threading.Thread, list[list[str]]]] = field(default_factory=list)

    def run(self, steps: list[dict[str, Any]]) -> None:
        for i, step in enumerate(steps):
            if self.version not in step.get("only_versions", [self.version]):
                continue
            if step.get("join"):
                self.join()
                continue
            if not self.emu.alive():
                self.failures.append(f"{label(i, step)}: not sent, the emulator is dead")
                return
            time.sleep(step.get("sleep_s", 0))
            if step.get("background"):
                self.start(label(i, step), step)
            else:
                self.record(label(i, step), run_step(self.emu, step, self.ctx)[1])
        self.join()

    def start(self, name: str, step: dict[str, Any]) -> None:
        out: list[list[str]] = []
        thread = threading.Thread(
            target=lambda: out.append(run_step(self.emu, step, self.ctx)[1]), daemon=True
        )
        thread.start()
        self.pending.append((name, thread, out))

    def join(self) -> None:
        for name, thread, out in self.pending:
            thread.join(STEP_TIMEOUT_S)
            if thread.is_alive() or not out:
                self.failures.append(f"{name}: no answer within {STEP_TIMEOUT_S}s")
            else:
                self.record(name, out[0])
        self.pending.clear()

    def record(self, name: str, problems: list[str]) -> None:
        if problems:
            self.failures.append(f"{name}: {'; '.join(problems)}")


@pytest.mark.parametrize(("sequence", "version"), list(cases()))
def test_client_replay(
    sequence: str, version: str, start_emulator: Callable[..., Emulator], tmp_path: Path
) -> None:
    seq = load(REPLAYS / sequence)
    ctx = Context(tmp_path)
    for name, spec in seq.get("placeholders", {}).items():
        ctx.build(name, spec["kind"])
    write_weights(
        tmp_path / "launch-model", "1"
    )  # Emulator's --model-path: a real checkpoint, as SGLang needs
    emu = start_emulator(
        version,
        *seq["emulator_args"],
        memory_saver=False,  # the sequence's own flags say whether the client launches with it
        tps=seq.get("tokens_per_second", 0),
        env=seq.get("emulator_env"),
    )
    launch_fails = seq.get("launch_fails_at", {})
    if version in launch_fails.get("versions", []):
        try:
            code = emu.wait_exit(15)
        except subprocess.TimeoutExpired:
            code = 0
        assert code != 0, f"the emulator started, but real SGLang {version} does not: {launch_fails['why']}"
        return
    emu.wait_ready()
    replay = Replay(emu, ctx, version)
    replay.run(seq["steps"])
    if not (emu.alive() and send(emu.url, "GET", "/model_info", {}, None).status == 200):
        replay.failures.append("the emulator is not alive (or /model_info does not answer 200) at the end")
    assert not replay.failures, f"{sequence} at {version}:\n" + "\n".join(replay.failures)
