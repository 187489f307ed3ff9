"""Replaying a real SGLang client's recorded HTTP sequence (tests/replays/<name>.json): its placeholders
filled the way the client builds them, each step sent as the exact bytes and headers the client's HTTP
library writes, the client's own retry loop, and the reply checked against the step's `expect` (status,
content type, each field the client reads). The file format is described in each file's "format" key.

Used by tests/agent/test_client_replay.py (against the emulator) and rljob.testing.framework_trainer
(against the agent's SGLang-compatible endpoint)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.packing import Call, Global, Instance

LOCAL_SERIALIZED_TENSOR = Global("sglang.srt.model_executor.model_runner", "LocalSerializedTensor")
STEP_TIMEOUT_S = 60.0
CHECKPOINT_BYTES = 16 << 10

Step = dict[str, Any]


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


# --- payloads the clients build with torch + SGLang's MultiprocessingSerializer, written without torch ---


def client_reduction(nbytes: int, dtype: str = "uint8", shape: tuple[int, ...] | None = None) -> Call:
    """reduce_tensor of a CUDA tensor with a made-up IPC handle, the device as the UUID SGLang's patched
    reduction sends (C-REFIT-IPC-DEVICE)."""
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


def local_serialized_named_tensors(module: str = LOCAL_SERIALIZED_TENSOR.module) -> bytes:
    """verl (sglang.srt.weight_sync.utils.update_weights): [(name, LocalSerializedTensor(values=[one pickled
    tensor per TP rank]))], pickled: the bytes verl's HTTP adapter base64-encodes. `module`: where the SGLang
    version defines LocalSerializedTensor (model_runner up to 0.5.15.post1; from 0.5.20
    model_runner_components.weight_updater)."""
    cls = Global(module, LOCAL_SERIALIZED_TENSOR.name)
    items = [
        (name, Instance(cls, {"values": [packing.dumps(reduction)]})) for name, reduction in named_tensors()
    ]
    return packing.dumps(items)


def local_serialized_named_tensors_b64() -> str:
    """local_serialized_named_tensors(), base64: the string on the wire."""
    return packing.to_wire(local_serialized_named_tensors())


def named_tensors_b64() -> str:
    """Engine.update_weights_from_tensor: [(name, tensor)] pickled per TP rank, base64."""
    return packing.to_wire(packing.dumps(named_tensors()))


def checkpoint_dir(directory: Path, version: str, size: int = CHECKPOINT_BYTES) -> Path:
    """A directory holding a real safetensors checkpoint of `version` (what a trainer saves and SGLang loads
    by its model_path)."""
    from rljob.testing.trainer import make_tensors, write_checkpoint

    return write_checkpoint(directory, version, make_tensors(version, size)).parent


@dataclass
class Context:
    """The values of a sequence's {{PLACEHOLDERS}}; `tmp` holds the files the builders write."""

    tmp: Path
    values: dict[str, str] = field(default_factory=dict)
    # Builders by kind that replace the stand-ins (real CUDA tensors where a real server opens the handles).
    builders: dict[str, Callable[[], str]] = field(default_factory=dict)

    def build(self, name: str, kind: str) -> None:
        if kind in self.builders:
            self.values[name] = self.builders[kind]()
            return
        builders: dict[str, Callable[[], str]] = {
            "flattened_bucket_b64": flattened_bucket_b64,
            "local_serialized_named_tensors_b64": local_serialized_named_tensors_b64,
            "named_tensors_b64": named_tensors_b64,
            "weights_dir": lambda: str(checkpoint_dir(self.tmp / f"ckpt-{name.lower()}", "2")),
            "missing_path": lambda: str(self.tmp / "no-such-checkpoint"),
            "launch_model_path": lambda: str(self.tmp / "launch-model"),
        }
        self.values[name] = builders[kind]()

    def build_all(self, seq: dict[str, Any]) -> None:
        for name, spec in seq.get("placeholders", {}).items():
            if name not in self.values:
                self.build(name, spec["kind"])

    def fill(self, text: str) -> str:
        for name, value in self.values.items():
            text = text.replace("{{" + name + "}}", value)
        assert "{{" not in text, f"unfilled placeholder in {text[:200]}"
        return text

    def fill_value(self, value: Any) -> Any:
        return self.fill(value) if isinstance(value, str) else value


# --- sending -------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    content_type: str
    text: str
    error: str = ""

    def json(self) -> Any:
        return json.loads(self.text)


def send(
    url: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None,
    timeout: float = STEP_TIMEOUT_S,
) -> Answer:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheader("Content-Type") or "", resp.read().decode(errors="replace"))
    except OSError as e:
        return Answer(0, "", "", f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def run_step(url: str, step: Step, ctx: Context, timeout: float = STEP_TIMEOUT_S) -> tuple[Answer, list[str]]:
    """Sends `step` (its retry loop included) and checks the last answer against its `expect`."""
    body = step.get("body")
    data = ctx.fill(body).encode() if body is not None else None
    path = ctx.fill(step["path"])
    retry = step.get("retry")
    attempts = retry["max_attempts"] if retry else 1
    for attempt in range(attempts):
        answer = send(url, step["method"], path, step.get("headers", {}), data, timeout)
        if not retry or answer.status == retry["until_status"] or attempt == attempts - 1:
            break
        time.sleep(retry["interval_s"])
    return answer, check(step, answer, ctx)


def label(i: int, step: Step) -> str:
    wire = step.get("wire", "http")
    return f"step {i} {step['method']} {step['path']} ({step['name']}; {wire}; {step['cite']})"


# --- checking ------------------------------------------------------------------------------------------

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


def _step_into(v: Any, part: str, path: str) -> list[Any]:
    if part == "[*]":
        if not isinstance(v, list) or not v:
            raise LookupError(f"{part!r} of {path}: not a non-empty list ({type(v).__name__})")
        return list(v)
    if part.startswith("["):
        i = int(part[1:-1])
        if not isinstance(v, list) or len(v) <= i:
            raise LookupError(f"{part!r} of {path}: no element {i}")
        return [v[i]]
    if not isinstance(v, dict) or part not in v:
        raise LookupError(f"{part!r} of {path}: missing")
    return [v[part]]


def resolve(doc: Any, path: str) -> list[Any]:
    """The values at `path` (a.b[0][*]); [*] fans out over a list and needs at least one element. Raises
    LookupError naming the first missing part."""
    values = [doc]
    for part in path.replace("[", ".[").split("."):
        if part:
            values = [x for v in values for x in _step_into(v, part, path)]
    return values


def _check_head(expect: dict[str, Any], answer: Answer) -> list[str]:
    problems: list[str] = []
    if "status" in expect and answer.status != expect["status"]:
        problems.append(f"status {answer.status}, expected {expect['status']}: {answer.text[:300]!r}")
    if "content_type" in expect and answer.content_type.split(";")[0].strip() != expect["content_type"]:
        problems.append(f"Content-Type {answer.content_type!r}, expected {expect['content_type']!r}")
    return problems


def _read_problem(doc: Any, read: dict[str, Any]) -> str | None:
    where = f"reads {read['path']} ({read['cite']})"
    try:
        values = resolve(doc, read["path"])
    except LookupError as e:
        return f"{where}: {e}"
    for v in values:
        if not TYPES[read["type"]](v):
            return f"{where}: {type(v).__name__} {v!r:.80}, not {read['type']}"
        if "len" in read and len(v) != read["len"]:
            return f"{where}: length {len(v)}, not {read['len']}"
    return None


def _value_problem(doc: Any, path: str, want: Any, *, equal: bool) -> str | None:
    try:
        got = resolve(doc, path)
    except LookupError as e:
        return f"{'equals' if equal else 'not_equals'} {path}: {e}"
    if equal and any(g != want for g in got):
        return f"{path} = {got!r:.120}, expected {want!r}"
    if not equal and any(g == want for g in got):
        return f"{path} = {want!r}, which the client asserts against"
    return None


def _field_problems(expect: dict[str, Any], doc: Any, ctx: Context) -> list[str]:
    found = [_read_problem(doc, read) for read in expect.get("reads", [])]
    found += [
        _value_problem(doc, p, ctx.fill_value(w), equal=True) for p, w in expect.get("equals", {}).items()
    ]
    found += [_value_problem(doc, p, w, equal=False) for p, w in expect.get("not_equals", {}).items()]
    return [p for p in found if p is not None]


def check(step: Step, answer: Answer, ctx: Context) -> list[str]:
    """What in `answer` the client would not accept: status, content type, and each field of `expect`."""
    expect = step.get("expect", {})
    if answer.error:
        return [f"no answer: {answer.error}"]
    problems = _check_head(expect, answer)
    if not any(expect.get(k) for k in ("reads", "equals", "not_equals")):
        return problems
    try:
        doc = answer.json()
    except ValueError:
        return problems or [f"reply is not JSON: {answer.text[:300]!r}"]
    return problems + _field_problems(expect, doc, ctx)
