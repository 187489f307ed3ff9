"""A trainer that drives the handoff through the frameworks' own client classes, installed from the package
index (`make install`: verl and AReaL without their dependencies, their imports from the `frameworks` extra),
pointed at the agent's SGLang-compatible endpoint ($RLJOB_ENGINE_URL): their code on the wire, not a
recording (for the recordings: rljob.testing.framework_trainer).

    python -m rljob.testing.framework_clients --framework verl|areal [--iterations N]
    env: RLJOB_ENGINE_URL, RLJOB_ITERATIONS (N when --iterations is not given), RLJOB_WEIGHTS_DIR (AReaL's
         checkpoints), RLJOB_POD_INDEX, RLJOB_SGLANG_CACHE (SGLang's unpacked wheels, hack/sglang-wheels.sh)

- verl 0.9.1, `verl.workers.rollout.sglang_rollout.http_server_engine.AsyncHttpServerAdapter(launch_server=
  False)`, its defaults (timeout 60 s, 3 attempts) unchanged. Each iteration: two `generate` calls, then
  the weight sync of its HYBRID mode (verl/checkpoint_engine/base.py, sglang_rollout.py):
  `release_memory_occupation(["kv_cache", "weights"])` (in-process in verl's HYBRID mode; over HTTP under
  an RLJob, the one change docs/frameworks.md names), `resume_memory_occupation(["weights"])`,
  `update_weights_from_tensor` (one bucket as SGLang's weight_sync.utils builds it: LocalSerializedTensor,
  flush_cache true),
  `flush_cache()`, `resume_memory_occupation(["kv_cache"])`. The adapter subclasses SGLang's EngineBase:
  SGLang 0.5.20's modules (the newest recorded version whose EngineBase verl 0.9.1 implements whole; its
  own pin, 0.5.12, is not unpacked) are put on sys.path.
- AReaL 1.0.4, `areal.engine.sglang_remote.RemoteSGLangEngine.initialize(addr=...)`, the sequence of
  areal/trainer/rl_trainer.py and its FSDP engine's disk update: at start-up `pause`, `pause_generation`,
  `offload`; each step `onload`, `continue_generation`, `resume`, two `agenerate`, `pause`,
  `pause_generation`, `offload`, then the disk update: `pause_generation`, `update_weights_from_disk`
  (the checkpoint saved and announced through AReaL's name_resolve, as its trainer does),
  `continue_generation`. After the last step's update it ends (no onload follows).

The CUDA tensors of verl's push are the stand-in IPC reduction the replays use (no GPU here). One JSON line
per call on stdout (event, iteration, call, seconds); exits 0 after the last iteration, 2 when a client call
raised (the exception on stderr)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from rljob.testing.client_replay import checkpoint_dir, local_serialized_named_tensors
from rljob.testing.framework_trainer import engine_url

VERL_SGLANG = "0.5.20"  # SGLang's modules verl's adapter imports (see the docstring)
PROMPTS = ([9707, 11, 1879, 0], [785, 6722, 315, 9625, 374])
T = TypeVar("T")


def _log(**fields: Any) -> None:
    sys.stdout.write(json.dumps({"ts": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()


def timed(iteration: int, call: str, fn: Callable[[], T]) -> T:
    began = time.monotonic()
    out = fn()
    _log(event="call", iteration=iteration, call=call, seconds=round(time.monotonic() - began, 3))
    return out


async def atimed(iteration: int, call: str, coro: Awaitable[T]) -> T:
    began = time.monotonic()
    out = await coro
    _log(event="call", iteration=iteration, call=call, seconds=round(time.monotonic() - began, 3))
    return out


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return host, int(port)


# --- verl -------------------------------------------------------------------------------------------


async def run_verl(url: str, iterations: int) -> None:
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.weight_sync.utils import LocalSerializedTensor
    from verl.workers.rollout.sglang_rollout.http_server_engine import AsyncHttpServerAdapter

    host, port = _host_port(url)
    # No server to launch: the endpoint stands where verl's SGLang server would. model_path is ServerArgs'
    # required field; the adapter never reads it.
    adapter = AsyncHttpServerAdapter(launch_server=False, host=host, port=port, model_path="served-model")
    for i in range(1, iterations + 1):
        for n, prompt in enumerate(PROMPTS):
            params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
            out = await atimed(
                i, f"generate {n}", adapter.generate(input_ids=list(prompt), sampling_params=params)
            )
            if "meta_info" not in out:
                raise RuntimeError(f"generate answered without meta_info: {out}")
        await atimed(
            i, "release_memory_occupation", adapter.release_memory_occupation(["kv_cache", "weights"])
        )
        await atimed(i, "resume_memory_occupation weights", adapter.resume_memory_occupation(["weights"]))
        bucket = local_serialized_named_tensors(LocalSerializedTensor.__module__)
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[bucket], load_format=None, flush_cache=True
        )
        reply = await atimed(i, "update_weights_from_tensor", adapter.update_weights_from_tensor(req))
        if not reply.get("success"):
            raise RuntimeError(f"update_weights_from_tensor: {reply}")
        await atimed(i, "flush_cache", adapter.flush_cache())
        await atimed(i, "resume_memory_occupation kv_cache", adapter.resume_memory_occupation(["kv_cache"]))


# --- AReaL ------------------------------------------------------------------------------------------


def run_areal(url: str, iterations: int, weights_dir: Path, pod: str) -> None:
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
    from areal.api.io_struct import ModelRequest, WeightUpdateMeta
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils import name_resolve, names

    experiment, trial = "rljob", f"pod{pod}"  # one trial per pod: the pods share this host's /tmp
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(weights_dir / "name_resolve")))
    engine = RemoteSGLangEngine(
        InferenceEngineConfig(backend="sglang:d1", experiment_name=experiment, trial_name=trial)
    )
    engine.initialize(addr=url.removeprefix("http://").rstrip("/"))
    # The checkpoint stays after the load (AReaL removes it by default): the RLJob records its path as the
    # committed weights, which a recreated gang loads.
    meta = WeightUpdateMeta.from_disk(experiment, trial, str(weights_dir), clear_checkpoint_after_load=False)

    def offload(i: int) -> None:  # rl_trainer.py _offload_rollout
        timed(i, "pause", engine.pause)
        timed(i, "pause_generation", engine.pause_generation)
        timed(i, "offload", engine.offload)

    offload(0)  # start-up (rl_trainer.py: the rollout starts offloaded)
    for i in range(1, iterations + 1):
        timed(i, "onload", engine.onload)  # rl_trainer.py _onload_rollout
        timed(i, "continue_generation", engine.continue_generation)
        timed(i, "resume", engine.resume)
        for n, prompt in enumerate(PROMPTS):
            req = ModelRequest(input_ids=list(prompt), gconfig=GenerationHyperparameters(max_new_tokens=8))
            out = timed(i, f"agenerate {n}", lambda r=req: asyncio.run(engine.agenerate(r)))
            if not out.output_tokens:
                raise RuntimeError(f"agenerate returned no tokens: {out}")
        offload(i)
        update_weights_from_disk(engine, meta.with_version(i), i, experiment, trial, names, name_resolve)
        engine.set_version(i)


def update_weights_from_disk(
    engine: Any, meta: Any, i: int, experiment: str, trial: str, names: Any, name_resolve: Any
) -> None:
    """areal/engine/fsdp_engine.py _update_weights_from_disk (rank 0): pause, ask the rollout to load,
    save the checkpoint, announce it, wait for the load, continue."""
    timed(i, "pause_generation (refit)", engine.pause_generation)
    future = engine.update_weights_from_disk(meta)
    checkpoint_dir(Path(meta.path), str(i))  # the trainer's save: a real checkpoint of version i
    name_resolve.add(
        names.update_weights_from_disk(experiment, trial, engine.get_version()),
        str(time.time()),
        keepalive_ttl=120,
    )
    timed(i, "update_weights_from_disk", future.result)
    timed(i, "continue_generation (refit)", engine.continue_generation)


# --- main -------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rljob.testing.framework_clients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--framework", choices=("verl", "areal"), required=True)
    p.add_argument("--iterations", type=int, default=int(os.environ.get("RLJOB_ITERATIONS", "3")))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    url = engine_url()
    if not url:
        return 1
    try:
        if args.framework == "verl":
            cache = Path(os.environ.get("RLJOB_SGLANG_CACHE", Path.home() / ".cache/rljob/sglang"))
            sys.path.insert(0, str(cache / VERL_SGLANG))
            asyncio.run(run_verl(url, args.iterations))
        else:
            weights = Path(os.environ.get("RLJOB_WEIGHTS_DIR", "/tmp/rljob-weights"))
            run_areal(url, args.iterations, weights, os.environ.get("RLJOB_POD_INDEX", "0"))
    except Exception:
        traceback.print_exc()
        return 2
    _log(event="done", iterations=args.iterations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
