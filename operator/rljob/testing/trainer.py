"""Simulated trainer: the end-to-end proof that no stale weights or KV are ever served.

Loop: wait until the agent reports Serving; send rollout requests (a shared prompt prefix, several
samples per prompt, `--concurrency` requests in flight) to the engine (SGLang's /generate, vLLM's
/v1/completions) and check every answer's weight version (SGLang's meta_info.weight_version and per-token
spans; vLLM's weight_versions spans, where its version carries them) equals the served version and that
the text is not garbage; compute a policy-gradient loss from the answers' output_token_logprobs (asked with
`return_logprob`) and log it with the rollout; report the samples to the agent (`handoff.report_rollout`);
then take the GPU lease, write a real safetensors checkpoint for version int(served)+1, publish it, and
for tensor/distributed refits push it through the agent's refit window. Exits 2 with a message when a
check fails, 4 when an answer has no usable logprobs.

    python -m rljob.testing.trainer [--iterations N] [--prompts P] [--samples-per-prompt K] ...
    env: RLJOB_AGENT_URL, RLJOB_ENGINE (sglang|vllm), RLJOB_ENGINE_SERVER_URL, RLJOB_REFIT_SOURCE
    (disk|tensor|distributed), RLJOB_WEIGHTS_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from rljob.api.spec import DEFAULT_ENGINE, EngineKind
from rljob.emulator.rendezvous import Rank0
from rljob.emulator.tokens import GARBAGE_MARKER
from rljob.testing.collective import BACKENDS, World, WorldError
from rljob.testing.collective import join as join_world
from rljob.testing.emulated_gpu import EmulatedGpuMemory
from rljob.testing.ipc_stand_in import cuda_reduction, share, vllm_update
from rljob.testing.rollout_gate import RolloutGate
from rljob.trainer import Handoff
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.digest import ModelLayout, checkpoint_digest, digest_named_tensors
from rljob.trainer.engines.vllm import digest as vllm_digest


class StaleServing(Exception):
    """SGLang answered with the wrong weights (version or garbage): the invariant this program checks."""


class BadRollout(Exception):
    """A rollout answer the loss cannot use: logprobs missing or not those of the returned tokens."""


def reward(output_ids: list[int]) -> float:
    """The task this trainer optimizes: the fraction of generated tokens with an even id."""
    return sum(1 for t in output_ids if t % 2 == 0) / len(output_ids) if output_ids else 0.0


def token_logprobs(response: dict[str, Any]) -> list[float]:
    """meta_info.output_token_logprobs of one answer, checked against output_ids: one
    [logprob, token_id, text] per generated token, each a log-probability (<= 0)."""
    meta = response["meta_info"]
    entries = meta.get("output_token_logprobs")
    ids = response.get("output_ids") or []
    if entries is None:
        raise BadRollout(f"request {meta.get('id')}: no output_token_logprobs (asked with return_logprob)")
    if len(entries) != len(ids) or [int(e[1]) for e in entries] != list(ids):
        raise BadRollout(f"request {meta.get('id')}: output_token_logprobs do not match output_ids")
    values = [e[0] for e in entries]
    if any(v is None or not float(v) <= 0.0 for v in values):
        raise BadRollout(f"request {meta.get('id')}: output logprob not a log-probability: {values}")
    return [float(v) for v in values]


def policy_gradient_loss(groups: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """REINFORCE with a per-prompt baseline (the group's mean reward): loss = -mean over samples of
    advantage * mean token logprob. Its value at the rollout policy is what a trainer's first step sees.
    Aborted samples (a drain) carry no full sequence and are left out."""
    terms: list[float] = []
    rewards: list[float] = []
    lps: list[float] = []
    for group in groups:
        done = [r for r in group if (r["meta_info"].get("finish_reason") or {}).get("type") != "abort"]
        scored = [(reward(r["output_ids"]), token_logprobs(r)) for r in done if r.get("output_ids")]
        if not scored:
            continue
        baseline = sum(rw for rw, _ in scored) / len(scored)
        for rw, lp in scored:
            terms.append(-(rw - baseline) * sum(lp) / len(lp))
            rewards.append(rw)
            lps += lp
    if not terms:
        return {"loss": None, "reward": None, "logprob_mean": None, "scored": 0}
    return {
        "loss": sum(terms) / len(terms),
        "reward": sum(rewards) / len(rewards),
        "logprob_mean": sum(lps) / len(lps),
        "scored": len(terms),
    }


def _log(event: str, **fields: Any) -> None:
    # One write per line: the processes of a pod (torchrun) share the container's stdout.
    sys.stdout.write(json.dumps({"event": event, "ts": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()


def next_version(served: str | None) -> str:
    return str(int(served) + 1) if served is not None and served.isdigit() else "1"


def make_tensors(version: str, total_bytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(version) if version.isdigit() else abs(hash(version)) % 2**32)
    cols = 256
    rows = max(1, total_bytes // (4 * cols * 4))
    return {
        f"model.layers.{i}.mlp.weight": rng.standard_normal((rows, cols), dtype=np.float32) for i in range(4)
    }


# The simulated model's config.json: a Llama (its tensors' names are kept as they are by SGLang's loader),
# so that a checkpoint directory is what trainers save and the digest knows how SGLang holds it.
SIM_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False}
SIM_LAYOUT = ModelLayout.from_config(SIM_CONFIG)
IPC_DIR_ENV = "RLJOB_IPC_STAND_IN_DIR"  # where the pushed tensors' bytes are shared with the emulator


def tensor_payload(name: str, array: np.ndarray, shared: Path | None = None) -> bytes:
    """`array` as one flattened bucket in SGLang's push format (what the emulator reads as SGLang does).
    Its CUDA IPC reduction is a stand-in (no torch or GPU here) whose handle is the data's sha256, so the
    payload, and the checksum the emulator keeps over it, change with the data. With `shared`, the bytes
    behind the handle are shared there (ipc_stand_in.share): the emulator holds them as pushed."""
    digest = hashlib.sha256(array.tobytes()).digest()
    nbytes = int(array.nbytes)
    if shared is not None:
        ipc = share(array.tobytes(), shared)
    else:
        ipc = cuda_reduction(
            nbytes, device="GPU-0", handle=digest * 2, ref_counter=b"/torch_1", event=digest * 2
        )
    entry = packing.metadata_entry(name, array.shape, str(array.dtype), 0, nbytes)
    return packing.bucket_payload(ipc, [entry])


def rewrite_checkpoint(path: Path, name: str) -> None:
    """The checkpoint at `path` changed after it was published: tensor `name` rewritten in place (other
    bytes), the file replaced atomically as a trainer's later save would."""
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    tensors[name] = tensors[name] + np.float32(1.0)
    tmp = path.with_suffix(".rewrite")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def write_checkpoint(weights_dir: Path, version: str, tensors: dict[str, np.ndarray]) -> Path:
    weights_dir.mkdir(parents=True, exist_ok=True)
    config = weights_dir / "config.json"
    if not config.exists():  # the model's config beside its weights, as a trainer's save writes it
        tmp_config = config.with_suffix(f".tmp{os.getpid()}")
        tmp_config.write_text(json.dumps(SIM_CONFIG))
        tmp_config.replace(config)
    # One file per pod: trainers of a gang may share a volume (a claim that outlives the pods).
    pod = os.environ.get("RLJOB_POD_INDEX")
    path = weights_dir / (
        f"weights-v{version}-pod{pod}.safetensors" if pod else f"weights-v{version}.safetensors"
    )
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # the processes of one pod (torchrun) write the same file
    save_file(tensors, str(tmp), metadata={"weight_version": version})
    tmp.replace(path)  # a reader never sees a half-written file
    return path


def from_vllm(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A vLLM /v1/completions answer as the answers of SGLang's /generate this trainer reads: one per
    choice, with its token ids, logprobs, finish reason and, where vLLM's version stamps outputs (0.34's
    `weight_versions`; the key is absent before), the versions its tokens came from. `labelled` says
    whether the answer carries a version at all (vLLM 0.26's never does: the agent owns the label)."""
    usage = response.get("usage") or {}
    # usage counts the prompt the n samples share once: the first answer carries it. vLLM reports cached
    # tokens per request only when launched with --enable-prompt-tokens-details (its /metrics count them).
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    out = []
    for n, choice in enumerate(response["choices"]):
        lp = choice.get("logprobs") or {}
        ids = list(choice.get("token_ids") or [])
        values, texts = lp.get("token_logprobs"), list(lp.get("tokens") or [])
        # One [logprob, token id, text] per logprob: a count that differs from the ids is token_logprobs'.
        meta: dict[str, Any] = {
            "id": f"{response['id']}-{choice['index']}",
            "finish_reason": {"type": choice.get("finish_reason")},
            "output_token_logprobs": (
                None
                if values is None
                else [
                    [v, ids[i] if i < len(ids) else -1, texts[i] if i < len(texts) else ""]
                    for i, v in enumerate(values)
                ]
            ),
            "prompt_tokens": prompt_tokens if n == 0 else 0,
            "cached_tokens": cached_tokens if n == 0 else 0,
        }
        labelled = "weight_versions" in choice and bool(ids)  # no tokens: no version to judge
        spans = choice.get("weight_versions") or []
        if labelled:
            meta["weight_version"] = spans[-1]["version"] if spans else None
            meta["weight_versions"] = spans
        out.append(
            {"text": choice.get("text", ""), "output_ids": ids, "meta_info": meta, "labelled": labelled}
        )
    return out


class Rollout:
    def __init__(
        self,
        engine_url: str,
        api_key: str | None,
        args: argparse.Namespace,
        engine: EngineKind = DEFAULT_ENGINE,
    ) -> None:
        self.url = engine_url.rstrip("/")
        self.engine = engine
        # A follower pod of a multi-node instance has no SGLang API (C-NODE): its instance's leader generates.
        # Under torchrun (processesPerPod > 1) LOCAL_RANK 0 generates for the pod.
        self.generates = all(os.environ.get(k, "0") == "0" for k in ("RLJOB_NODE_RANK", "LOCAL_RANK"))
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.args = args

    def _generate(self, prompt: str) -> list[dict[str, Any]]:
        if self.engine == EngineKind.VLLM:
            body: dict[str, Any] = {
                "prompt": prompt,
                "n": self.args.samples_per_prompt,
                "max_tokens": self.args.max_new_tokens,
                "temperature": 1.0,
                "logprobs": 0,  # the sampled token's own logprob: the loss is computed from them
                "return_token_ids": True,
                "return_weight_versions": True,  # 0.34 stamps outputs with versions; 0.26 ignores it
            }
            return from_vllm(self._post("/v1/completions", body))
        body = {
            "text": [prompt] * self.args.samples_per_prompt,
            "sampling_params": {"max_new_tokens": self.args.max_new_tokens, "temperature": 1.0},
            "return_logprob": True,  # the loss is computed from the rollout's own logprobs
        }
        out = self._post("/generate", body)
        return out if isinstance(out, list) else [out]

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), self.headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.args.request_timeout) as resp:
            return json.loads(resp.read())

    def run(self, iteration: int, served: str) -> dict[str, Any]:
        if not self.generates:
            empty = {"responses": 0, "completed": 0, "cached_tokens": 0, "prompt_tokens": 0}
            return {**empty, **policy_gradient_loss([])}
        prefix = " ".join(f"sys{i}" for i in range(self.args.prefix_tokens))
        prompts = [f"{prefix} question-{iteration}-{i} please answer" for i in range(self.args.prompts)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.args.concurrency, len(prompts)))) as pool:
            groups = list(pool.map(self._generate, prompts))
        results = [r for batch in groups for r in batch]
        cached = prompt_tokens = completed = 0
        for r in results:
            meta = r["meta_info"]
            self.check(r, served)
            cached += int(meta.get("cached_tokens", 0))
            prompt_tokens += int(meta.get("prompt_tokens", 0))
            completed += (meta.get("finish_reason") or {}).get("type") != "abort"
        return {
            "responses": len(results),
            "completed": completed,
            "cached_tokens": cached,
            "prompt_tokens": prompt_tokens,
            **policy_gradient_loss(groups),
        }

    @staticmethod
    def check(response: dict[str, Any], served: str) -> None:
        meta = response["meta_info"]
        if meta.get("finish_reason", {}).get("type") == "abort":
            return  # aborted by a drain: no tokens to judge
        # An engine whose answers carry no version (vLLM 0.26): only their content can be judged.
        if response.get("labelled", True) and meta.get("weight_version") != served:
            raise StaleServing(
                f"request {meta.get('id')} served by weight_version {meta.get('weight_version')!r}, "
                f"but the agent reports {served!r}"
            )
        for span in meta.get("weight_versions") or []:
            if span["version"] != served:
                raise StaleServing(
                    f"request {meta.get('id')} has tokens {span['start']}..{span['end']} "
                    f"from weight_version {span['version']!r}, expected {served!r}"
                )
        if GARBAGE_MARKER in response.get("text", ""):
            raise StaleServing(f"request {meta.get('id')} produced garbage: weights resumed without a refit")


def push_refit(
    handoff: Handoff, source: str, version: str, tensors: dict[str, np.ndarray], timeout: float
) -> None:
    with handoff.refit_window(timeout=timeout) as window:
        if window.version != version:
            raise StaleServing(
                f"refit window for version {window.version}, but this trainer published {version}"
            )
        names = sorted(tensors)
        if source == "tensor" and window.engine == "vllm":
            # vLLM's packed IPC update (V-REFIT-IPC): one stand-in buffer per tensor, pushed as updateInfo.
            shared = os.environ.get(IPC_DIR_ENV)
            for name in names:
                window.push_update(vllm_update({name: tensors[name]}, Path(shared) if shared else None))
            if shared:  # the emulator holds these bytes: what it holds must be their vLLM digest
                layout = vllm_digest.ModelLayout.from_config(SIM_CONFIG)
                window.add_digest(vllm_digest.digest_named_tensors([(n, tensors[n]) for n in names], layout))
        elif source == "tensor":
            shared = os.environ.get(IPC_DIR_ENV)
            for name in names:  # one bucket per tensor; one payload per TP rank (TP=1 here)
                payload = packing.to_wire(
                    tensor_payload(name, tensors[name], Path(shared) if shared else None)
                )
                window.push_tensors([payload], packing.LOAD_FORMAT)
            if shared:  # the emulator holds these bytes: what it holds must be their digest
                window.add_digest(digest_named_tensors([(n, tensors[n]) for n in names], SIM_LAYOUT))
        else:
            # The trainer is group rank 0 and hosts the group's store; SGLang's init_weights_update_group
            # answers only once its ranks joined it (C-REFIT-GROUP-BLOCK in docs/sglang-conformance.md),
            # so rank 0 serves while the agent makes that call. TP=1 here: world size 2.
            rank0 = Rank0(0, world_size=2)
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(rank0.wait, timeout)
                try:
                    window.init_group("127.0.0.1", rank0.port, rank_offset=1, world_size=2)
                except BaseException:
                    rank0.cancel()
                    raise
                joined.result(timeout)
            for name in names:
                t = tensors[name]
                window.push_distributed([name], [str(t.dtype)], [list(t.shape)])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rljob.testing.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--iterations", type=int, default=0, help="stop after N iterations (0: forever)")
    p.add_argument("--prompts", type=int, default=8, help="rollout prompts per iteration")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument(
        "--prefix-tokens", type=int, default=64, help="length of the prompt prefix all prompts share"
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--concurrency", type=int, default=4, help="rollout requests (one per prompt) in flight at once"
    )
    p.add_argument("--train-seconds", type=float, default=0.0)
    p.add_argument(
        "--world",
        choices=["none", *BACKENDS],
        default="none",
        help="form the trainer world from the injected env (MASTER_ADDR, WORLD_SIZE, RANK, ...) and run one "
        "checked all_reduce per training step: torch (gloo), tcp (no torch), auto (torch if importable; "
        "RLJOB_REQUIRE_TORCH=1 makes torch required); exits 3 when the world is not the env's",
    )
    p.add_argument("--weights-bytes", type=int, default=64 << 10, help="checkpoint size written per version")
    p.add_argument(
        "--gpu-bytes",
        type=int,
        default=0,
        help="emulated GPU memory per GPU the training step allocates while it holds the lease (needs the "
        "SGLang emulator at RLJOB_ENGINE_SERVER_URL)",
    )
    p.add_argument(
        "--keep-gpu-bytes", type=int, default=0, help="of it, what the trainer still holds after publishing"
    )
    p.add_argument(
        "--keep-seconds",
        type=float,
        default=-1.0,
        help="how long it keeps --keep-gpu-bytes after publishing (negative: until SIGUSR1 or its exit)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for Serving, lease, window")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument(
        "--gate-dir",
        help="wait at each rollout's first request and after its last answer for a test reading SGLang's "
        "/metrics there (rljob.testing.rollout_gate)",
    )
    return p


def published_digest(engine: EngineKind, path: Path) -> Any:
    """The checkpoint's digest as the pod's engine will hash it once loaded (each engine's checksum hashes
    its own parameters its own way: trainer/engines/<name>/digest.py)."""
    if engine == EngineKind.VLLM:
        return vllm_digest.checkpoint_digest(path)
    return checkpoint_digest(path)


def train_loop(
    args: argparse.Namespace,
    handoff: Handoff,
    rollout: Rollout,
    weights_dir: Path,
    source: str,
    *,
    stopping: Callable[[], bool] = lambda: False,
    on_step: Callable[[str, float], None] = lambda _version, _seconds: None,
    log: Callable[..., None] = _log,
    world: World | None = None,
    gpu: EmulatedGpuMemory | None = None,
    gate: RolloutGate | None = None,
) -> None:
    """The simulated trainer: rollout at the served version, lease, checkpoint, publish, refit push; then
    the final served version checked. `on_step(version, s)`: seconds from lease granted to publish
    answered. Raises StaleServing when SGLang serves anything but what this trainer published."""
    expected: str | None = None  # unknown after a (re)start: resume from what the agent serves
    iteration = 0
    while not stopping() and (args.iterations == 0 or iteration < args.iterations):
        iteration += 1
        served = handoff.wait_for_stage("Serving", timeout=args.timeout)["engine"]["servedVersion"]
        if expected is not None and served != expected:
            raise StaleServing(f"agent serves {served!r} after this trainer published {expected!r}")
        with gate.edges(iteration) if gate is not None else contextlib.nullcontext():
            stats = rollout.run(iteration, served)
        log("rollout", iteration=iteration, served=served, **stats)
        handoff.report_rollout(samples=stats["completed"])  # the job's cost per rollout divides by it
        version = next_version(served)
        tensors = make_tensors(version, args.weights_bytes)
        with handoff.train(timeout=args.timeout) as lease:
            granted = time.perf_counter()
            if gpu is not None:
                gpu.hold(args.gpu_bytes)  # the step's memory, in what the release freed
            time.sleep(args.train_seconds)
            if world is not None:  # the step's collective over every trainer process of the gang
                log("collective", iteration=iteration, **world.step())
            path = write_checkpoint(weights_dir, version, tensors)
            if gpu is not None:  # frees the step's memory, but for what it keeps after its lease
                gpu.hold_for(args.keep_gpu_bytes, args.keep_seconds)
            lease.publish(version, str(path), digest=published_digest(rollout.engine, path))
            on_step(version, time.perf_counter() - granted)
        log("published", iteration=iteration, version=version, path=str(path), source=source)
        if source != "disk" and rollout.generates:  # refit windows open on the leader's agent only
            push_refit(handoff, source, version, tensors, args.timeout)
        expected = version
    if stopping():
        return
    final = handoff.wait_for_stage("Serving", timeout=args.timeout)["engine"]["servedVersion"]
    if expected is not None and final != expected:
        raise StaleServing(f"agent serves {final!r} after this trainer published {expected!r}")
    log("done", iterations=iteration, served=final)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    source = os.environ.get("RLJOB_REFIT_SOURCE", "disk")
    if source not in ("disk", "tensor", "distributed"):
        print(f"RLJOB_REFIT_SOURCE must be disk, tensor or distributed, not {source!r}", file=sys.stderr)
        return 1
    try:
        engine = EngineKind(os.environ.get("RLJOB_ENGINE", DEFAULT_ENGINE.value))
    except ValueError:
        print(f"RLJOB_ENGINE must be one of {', '.join(EngineKind)}", file=sys.stderr)
        return 1
    rollout = Rollout(
        os.environ.get("RLJOB_ENGINE_SERVER_URL", "http://127.0.0.1:30000"),
        os.environ.get("RLJOB_ENGINE_API_KEY"),
        args,
        engine,
    )
    weights_dir = Path(os.environ.get("RLJOB_WEIGHTS_DIR", "/tmp/rljob-weights"))
    try:
        world = join_world(args.world) if args.world != "none" else None
        if world is not None:
            _log("world", backend=world.backend, world_size=world.size, rank=world.rank)
        gpu = None
        if args.gpu_bytes or args.keep_gpu_bytes:
            gpu = EmulatedGpuMemory(
                rollout.url, {k: v for k, v in rollout.headers.items() if k != "Content-Type"}
            )
            gpu.free_on(signal.SIGUSR1)
        gate = RolloutGate(Path(args.gate_dir), args.timeout) if args.gate_dir else None
        train_loop(args, Handoff(), rollout, weights_dir, source, world=world, gpu=gpu, gate=gate)
        return 0
    except StaleServing as e:
        print(f"STALE SERVING: {e}", file=sys.stderr, flush=True)
        return 2
    except BadRollout as e:
        print(f"BAD ROLLOUT: {e}", file=sys.stderr, flush=True)
        return 4
    except WorldError as e:
        print(f"WORLD: {e}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
