"""The differential runner's vLLM side (rljob.testing.differential): the stated state every sequence starts
from, the values compared by default, the state after a sequence, the sequences (tests/differential/vllm/
sequences.json and the replays of tests/replays/vllm/, each turned into runner steps) and their placeholders.
Rows: docs/vllm-conformance.md.

The stated state (VLLM.reset, not observed): the launch weights served, not paused, nothing asleep, the
prefix cache reset, built only from calls vLLM has at the version (0.34 also labels the weights "0").
The IPC payloads: stand-in handles for the emulator (`stand_in_builders`); on a GPU real CUDA tensors of the
launch checkpoint, held by this process, packed as the trainer SDK packs them (`real_builders`), because
real vLLM opens every handle it is sent and a handle it cannot open fails the update after its start
(V-KILL-REFIT-FAILED)."""

from __future__ import annotations

import json
import struct
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rljob.testing.client_replay import Context, send
from rljob.testing.differential import Engine, value_at

VERSIONS = ("0.26.0", "0.34.0")
RECORDED_ON_GPU = ("0.26.0",)  # 0.27+ pin another torch than the GPU machines' (docs/real-vllm.md)
_JSON = {"Content-Type": "application/json"}
_RPC_RELOAD_LAUNCH = '{"method": "reload_weights", "kwargs": {"weights_path": "{{LAUNCH_MODEL_PATH}}"}}'
RESET: tuple[dict[str, Any], ...] = (
    # V-ROUTE-WAKE, V-MEM-WAKE-TAGS: no tags wakes whatever sleeps; with nothing asleep it skips and resumes
    # the scheduler (V-MEM-WAKE-NOT-ASLEEP), so the reload below never writes to unmapped weights.
    {"method": "POST", "path": "/wake_up", "headers": {}, "body": None},
    # V-ROUTE-PAUSE, V-DRAIN-ABORT: nothing runs while the weights load (V-KILL-RELOAD-SERVING); its
    # clear_cache resets the prefix cache.
    {"method": "POST", "path": "/pause?mode=abort", "headers": {}, "body": None},
    # V-REFIT-DISK: the launch checkpoint again.
    {"method": "POST", "path": "/collective_rpc", "headers": _JSON, "body": _RPC_RELOAD_LAUNCH},
    # V-ROUTE-WV (0.34): the label the launch weights carry here.
    {
        "method": "POST",
        "path": "/update_weight_version",
        "headers": _JSON,
        "body": '{"new_version": "0"}',
        "only_versions": ["0.34.0"],
    },
    # V-ROUTE-FLUSH: `success` true (nothing holds a block while paused by abort).
    {"method": "POST", "path": "/reset_prefix_cache", "headers": {}, "body": None},
    # V-ROUTE-RESUME.
    {"method": "POST", "path": "/resume", "headers": {}, "body": None},
)
RESET_STATE = (
    'the launch weights served (0.34: labelled weight_version "0"), not paused, nothing asleep, the prefix '
    "cache reset"
)
DEFAULT_COMPARE = (
    "status",  # /pause, /resume: {"status": "paused" | "resumed"}; 0.34's /sleep, /wake_up
    "is_paused",
    "is_sleeping",
    "success",  # /reset_prefix_cache, /update_weight_version
    "message",  # the weight-transfer routes
    "results",  # /collective_rpc
    "world_size",
    "version",
    "weight_version",
    "new_version",
    "aborted",
    "level",
    "tags",
    "error.type",  # V-ROUTE-ERRORS: the envelope's type and code (its message only where a step asks)
    "error.code",
    "choices[0].finish_reason",
)
# Routes whose time is the card's or the model's (memory mapped and copied, tokens generated), not vLLM's.
UNTIMED = ("/sleep", "/wake_up", "/v1/completions")
PROBE = '{"model": "{{MODEL}}", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}'


def state_of(url: str, ctx: Context, version: str) -> dict[str, Any]:
    """What a client sees afterwards: paused, asleep, 0.34's weight label, and, when neither paused nor
    asleep, whether a 1-token completion answers (sent while paused it would wait: V-REQ-PAUSED)."""
    paused = _read(url, "/is_paused", "is_paused")
    sleeping = _read(url, "/is_sleeping", "is_sleeping")
    label = _read(url, "/weight_info", "weight_version") if version != "0.26.0" else None
    status = None
    if paused is False and sleeping is False:
        status = send(url, "POST", "/v1/completions", _JSON, ctx.fill(PROBE).encode(), timeout=30).status
    return {"is_paused": paused, "is_sleeping": sleeping, "weight_version": label, "generate_status": status}


def _read(url: str, path: str, key: str) -> Any:
    answer = send(url, "GET", path, {}, None, timeout=15)
    try:
        found, value = value_at(answer.json(), key)
    except ValueError:
        return None
    return value if found else None


VLLM = Engine("vLLM", RESET, RESET_STATE, DEFAULT_COMPARE, state_of)


# --- the sequences -----------------------------------------------------------------------------------------


def load_sequences(sequences_file: Path, replays_dir: Path) -> list[dict[str, Any]]:
    """The vLLM sequences, then each replay of `replays_dir` (named `replay:<file stem>`) as runner steps,
    then the fatal ones."""
    doc = json.loads(sequences_file.read_text())
    own = [{**seq, "placeholders": doc.get("placeholders", {})} for seq in doc["sequences"]]
    replays = [replay_sequence(p) for p in sorted(replays_dir.glob("*.json"))]
    ordered = own + replays
    return [s for s in ordered if not s.get("fatal")] + [s for s in ordered if s.get("fatal")]


def replay_sequence(path: Path) -> dict[str, Any]:
    """A framework's replay (tests/replays/vllm, its own format: `setup` and `iteration` steps with `query`
    pairs and JSON bodies) as runner steps: the query as aiohttp writes it, the body as json.dumps writes it
    (aiohttp's `json=`), `{{CHUNK}}` as the step's chunk placeholder; GPU work and generation untimed."""
    doc = json.loads(path.read_text())
    steps = []
    for step in [*doc.get("setup", []), *doc["iteration"]]:
        query = urllib.parse.urlencode([tuple(pair) for pair in step.get("query", [])])
        out: dict[str, Any] = {
            "method": step["method"],
            "path": step["path"] + (f"?{query}" if query else ""),
            "name": step["name"],
            "headers": _JSON if step.get("body") is not None else {},
            "body": None,
        }
        if step.get("body") is not None:
            body = json.dumps(step["body"])
            if "chunk" in step:
                body = body.replace('"{{CHUNK}}"', "{{CHUNK_" + str(step["chunk"]) + "}}")
            out["body"] = body
        if step["path"] in UNTIMED:
            out["timing"] = False
        steps.append(out)
    chunks = {f"CHUNK_{s['chunk']}": {"kind": "skyrl_chunk"} for s in doc["iteration"] if "chunk" in s}
    return {
        "name": f"replay:{path.stem}",
        "note": doc["format"]["what"],
        "steps": steps,
        "placeholders": chunks,
    }


# --- placeholders ---------------------------------------------------------------------------------------

_DTYPES = {"BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4), "U8": ("uint8", 1)}


def checkpoint_tensors(directory: Path) -> list[tuple[str, str, list[int]]]:
    """(name, torch dtype name, shape) of each tensor of a safetensors checkpoint, read from the headers."""
    out = []
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out.append((name, _DTYPES[meta["dtype"]][0], list(meta["shape"])))
    return out


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = {v[0]: v[1] for v in _DTYPES.values()}[dtype]
    for d in shape:
        n *= d
    return n


def stand_in_builders(launch: Path) -> dict[str, Callable[[], str]]:
    """The IPC payloads for the emulator: one packed buffer of the launch checkpoint's tensors behind a
    stand-in handle of the emulator's GPU 0 (rljob.testing.ipc_stand_in); SkyRL's chunks likewise."""
    from rljob.testing.ipc_stand_in import UUID, cuda_reduction
    from rljob.trainer.engines.sglang import packing as stand_in_pickle
    from rljob.trainer.engines.vllm import packing

    tensors = checkpoint_tensors(launch)
    sizes = [_nbytes(d, s) for _, d, s in tensors]
    # torch's reduction carries the device index (vLLM writes its own in: V-REFIT-IPC), not SGLang's UUID.
    buffer = cuda_reduction(sum(sizes), device=0)  # type: ignore[arg-type]

    def update(packed: bool) -> str:
        handles = stand_in_pickle.to_wire(stand_in_pickle.dumps({UUID: buffer.args}))
        info = packing.update_info(
            [n for n, _, _ in tensors], [d for _, d, _ in tensors], [s for _, _, s in tensors], sizes, handles
        )
        return json.dumps({**info, "packed": True} if packed else info)

    def skyrl_chunk() -> str:
        # cuda_ipc_strategy.py:198-250@a9564572: `sizes` in elements, {uuid: (rebuild, args)} pickled.
        rebuild = stand_in_pickle.Global("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
        numel = [s // _nbytes(d, [1]) for s, (_, d, _) in zip(sizes, tensors, strict=True)]
        handles = {UUID: (rebuild, buffer.args)}
        return json.dumps(
            {
                "names": [n for n, _, _ in tensors],
                "dtype_names": [d for _, d, _ in tensors],
                "shapes": [s for _, _, s in tensors],
                "sizes": numel,
                "ipc_handles_pickled": stand_in_pickle.to_wire(stand_in_pickle.dumps(handles)),
            }
        )

    return {
        "vllm_ipc_update": lambda: update(packed=False),
        "vllm_ipc_update_packed": lambda: update(packed=True),
        "skyrl_chunk": skyrl_chunk,
    }


_HELD: list[Any] = []  # the packed buffers stay alive while real vLLM may still open their handles


def real_builders(launch: Path) -> dict[str, Callable[[], str]]:
    """The IPC payloads for real vLLM on this process's GPU: the launch checkpoint's tensors as CUDA tensors,
    packed into one buffer by the trainer SDK (rljob.trainer.engines.vllm.packing), so an update loads the
    weights the server already serves. SkyRL's chunks stay stand-ins: plain vLLM has no SkyRL worker
    extension, so no handle of theirs is opened (`Method ... is not implemented`)."""

    def update(packed: bool) -> str:
        from safetensors.torch import load_file

        from rljob.trainer.engines.vllm import packing

        named = [
            (n, t) for f in sorted(launch.glob("*.safetensors")) for n, t in load_file(f, "cuda").items()
        ]
        (bucket,) = list(packing.buckets(named, bucket_bytes=1 << 40))
        _HELD.append(bucket.buffer)
        return json.dumps({**bucket.info, "packed": True} if packed else bucket.info)

    return {
        **stand_in_builders(launch),
        "vllm_ipc_update": lambda: update(packed=False),
        "vllm_ipc_update_packed": lambda: update(packed=True),
    }


def contexts(
    tmp: Path, launch: Path, builders: dict[str, Callable[[], str]] | None = None
) -> Callable[[str], Context]:
    """Per sequence a Context: MODEL (the served model name: the launch directory, as `vllm serve DIR`
    names it), LAUNCH_MODEL_PATH, WEIGHTS_DIR (the launch's tensors with other values: `_other_weights`),
    MISSING_PATH; the IPC payloads from `builders`
    (default: the stand-ins)."""
    weights = _other_weights(tmp / "weights-7", launch)

    def make(name: str) -> Context:
        values = {
            "MODEL": str(launch),
            "LAUNCH_MODEL_PATH": str(launch),
            "WEIGHTS_DIR": str(weights),
            "MISSING_PATH": str(tmp / "no-such-checkpoint"),
        }
        d = tmp / name.replace(":", "-")
        d.mkdir(parents=True, exist_ok=True)
        return Context(d, values, dict(builders if builders is not None else stand_in_builders(launch)))

    return make


def _other_weights(directory: Path, launch: Path) -> Path:
    """A checkpoint of the launch's tensors with other values: TinyLlama's seed 7 for a TinyLlama launch,
    rljob.testing.trainer's tensors of version 7 for one of those (vllm_procs.write_model), else the launch
    itself (a model of rljob.testing.gpu_models: a reload of it answers as one of other weights does)."""
    from rljob.testing.tiny_model import TinyLlama
    from rljob.testing.trainer import make_tensors, write_checkpoint

    tensors = {n: s for n, _, s in checkpoint_tensors(launch)}
    model = TinyLlama()
    if tensors == {n: list(s) for n, s in model.shapes().items()}:
        return model.write(directory, seed=7)
    rows = next(iter(tensors.values()), [0])[0]
    other = make_tensors("7", rows * 4 * 256 * 4)
    if tensors == {n: list(a.shape) for n, a in other.items()}:
        return write_checkpoint(directory, "7", other).parent
    return launch
