"""Real SGLang 0.5.15.post1 on the GPU, driven by the real agent (`--gpu-probe nvml`), with a real torch
trainer (real_trainer.py) in the memory SGLang releases.

test_agent_drives_real_sglang: 3 iterations (refit from disk, by tensor through the SDK's CUDA-IPC
packing, from disk). Each: 3 requests in flight, drain (abort), release of every tag verified by NVML, the
trainer allocates most of the freed memory, refit, resume; then SGLang's logprobs for fixed prompts equal
a transformers forward of the same weights in the trainer (LOGPROB_TOLERANCE), a prompt served
before the refit is not answered from its old cache, and SGLang never restarted. Between agent iterations
the test makes the same SGLang calls itself (no agent), so each phase's agent command compares with
SGLang's own calls in the same run. Figures: $RLJOB_GPU_RESULTS_DIR/real_sglang.{json,md}.

test_differential: every sequence of tests/differential/sequences.json and tests/replays to real SGLang
and to the emulator at the same version with the same flags; the real answers are written to
$RLJOB_GPU_RESULTS_DIR/real-0.5.15.post1.json (committed as tests/differential/real-0.5.15.post1.json,
which tests/agent/test_differential.py holds the emulator to in CI) with the differences table."""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, PY, Agent, AgentDriver, Emulator, Proc
from gpu_helpers import GiB, markdown_table, nvml_total, nvml_used, while_alive
from real_sglang import LAUNCH_FLAGS, VERSION, RealSGLang, sglang_missing

from rljob.testing import differential, real_payloads
from rljob.testing.tiny_model import TinyLlama

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DIFFERENTIAL = ROOT / "tests" / "differential"
EMULATOR_TPS = 1000  # the emulator's tokens per second per request: long requests are in flight for seconds
PLAN = ("disk", "tensor", "disk")
TRAINER_SEED_BASE = 100  # real_trainer.py's --seed-base: iteration i trains TinyLlama weights of seed 100 + i
# Nats per token, SGLang against the trainer's forward: both bf16, other kernels. The logits (std ~3, the
# largest 8-16) sit 0.0625 apart in bf16: this is 4 such steps; two versions differ by more than 1 nat.
LOGPROB_TOLERANCE = 0.25
IN_FLIGHT = 3
LONG = {"sampling_params": {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}}


class Launched:
    """The module's real SGLang and the model it serves; launched again before a test when the last one
    failed (it may have left the server paused, with tags released) or the server is gone."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.model = tmp, TinyLlama()
        self.launch = self.model.write(tmp / "v0", seed=0)
        self.server: RealSGLang | None = None
        self.dirty = True

    def ready(self) -> RealSGLang:
        if self.dirty or self.server is None or not self.server.alive():
            if self.server is not None:
                self.server.stop()
            self.server = RealSGLang(self.tmp, self.launch)
            self.server.wait_ready()
            self.dirty = False
        return self.server


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    reason = sglang_missing()
    if reason:
        pytest.skip(f"real-SGLang tier: {reason}")
    holder = Launched(tmp_path_factory.mktemp("real"))
    try:
        yield holder
    finally:
        if holder.server is not None:
            holder.server.stop()


@pytest.fixture
def real(launched: Launched, request: pytest.FixtureRequest) -> Iterator[tuple[RealSGLang, Path, TinyLlama]]:
    yield launched.ready(), launched.tmp, launched.model
    report = getattr(request.node, "rep_call", None)
    launched.dirty = report is None or not report.passed


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def tokens(text: str, model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)


def generate(server: RealSGLang, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, **extra}
    r = server.call("POST", "/generate", body)
    assert r.status == 200, r.text
    return dict(r.body)


def logprob_check(server: RealSGLang, ids: list[int], ref: dict[str, Any]) -> dict[str, Any]:
    """SGLang's input-token logprobs and greedy next token against the trainer's forward of the weights."""
    out = generate(server, ids, return_logprob=True, logprob_start_len=0)
    served = [lp for lp, _tok, *_ in out["meta_info"]["input_token_logprobs"][1:]]
    ((next_lp, next_tok, *_),) = out["meta_info"]["output_token_logprobs"]
    pairs = [*zip(served, ref["input_logprobs"], strict=True), (next_lp, ref["next_logprob"])]
    return {
        "max_abs_diff": max(abs(a - b) for a, b in pairs),
        "next_token": next_tok,
        "ref_next_token": ref["next_token"],
    }


class InFlight:
    """Long generations started before a drain: each must end (aborted) when the drain returns."""

    def __init__(self, server: RealSGLang, prompts: list[list[int]]) -> None:
        self.replies: list[Any] = []
        self.threads = [
            threading.Thread(target=self._one, args=(server, {**LONG, "input_ids": p}), daemon=True)
            for p in prompts
        ]
        for t in self.threads:
            t.start()

    def _one(self, server: RealSGLang, body: dict[str, Any]) -> None:
        r = server.call("POST", "/generate", body, timeout=120)
        self.replies.append(r.body if r.status == 200 else r.text)

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(60)
        return [
            r["meta_info"]["finish_reason"]["type"] if isinstance(r, dict) else f"error {r}"
            for r in self.replies
        ]


def wait_running(server: RealSGLang, n: int, timeout: float = 10) -> None:
    """Until the scheduler runs `n` requests (/get_load: the 0.5.15.post1 shim over its snapshots)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = server.call("GET", "/get_load")
        if r.status == 200 and sum(x["num_reqs"] - x["num_waiting_reqs"] for x in r.body) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} requests not running within {timeout}s")


def verify_refit(
    server: RealSGLang,
    prompts: dict[str, list[int]],
    cached: str,
    version: str,
    ref: dict[str, Any],
    prev: dict[str, Any] | None,
) -> dict[str, Any]:
    """After a refit to `version`: no stale KV (the prompt `cached` was served and cached before the refit;
    now it is computed anew, with the new weights), and SGLang's logprobs for every prompt equal the
    trainer's forward of the weights it pushed (`ref`); the previous version's (`prev`) are far off."""
    out: dict[str, Any] = {}
    after = generate(server, prompts[cached])
    out["cached_tokens_after_refit"] = after["meta_info"]["cached_tokens"]
    assert out["cached_tokens_after_refit"] == 0, after["meta_info"]
    assert after["output_ids"][0] == ref[cached]["next_token"], (after, ref[cached])
    assert after["meta_info"]["weight_version"] == version
    out["logprobs"] = {name: logprob_check(server, ids, ref[name]) for name, ids in prompts.items()}
    out["logprob_max_abs_diff"] = max(x["max_abs_diff"] for x in out["logprobs"].values())
    assert out["logprob_max_abs_diff"] <= LOGPROB_TOLERANCE, out["logprobs"]
    assert all(x["next_token"] == x["ref_next_token"] for x in out["logprobs"].values()), out["logprobs"]
    if prev is not None:
        out["previous_version_diff"] = logprob_check(server, prompts["fixed"], prev["fixed"])["max_abs_diff"]
        assert out["previous_version_diff"] > 1, "the previous version's logprobs are as close as this one's"
    return out


def timed(server: RealSGLang, method: str, path: str, body: Any = None) -> float:
    t0 = time.perf_counter()
    r = server.call(method, path, body)
    seconds = time.perf_counter() - t0
    assert r.status == 200, f"{path}: {r.status} {r.text}"
    if isinstance(r.body, dict) and "success" in r.body:
        assert r.body["success"] is True, r.body
    return seconds


def sglang_own_iteration(
    server: RealSGLang, ckpt: Path, version: str, prompts: list[list[int]]
) -> dict[str, float]:
    """One iteration of SGLang's own calls, no agent: what each phase's agent command is compared with."""
    flight = InFlight(server, prompts)
    wait_running(server, IN_FLIGHT)
    own = {"drain": timed(server, "POST", "/pause_generation", {"mode": "abort"})}
    assert set(flight.join()) == {"abort"}
    own["release"] = timed(server, "POST", "/release_memory_occupation", {"tags": ALL_TAGS})
    own["refit"] = timed(server, "POST", "/resume_memory_occupation", {"tags": ["cuda_graph", "weights"]})
    own["refit"] += timed(
        server, "POST", "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": version}
    )
    own["resume"] = timed(server, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    own["continue"] = timed(server, "POST", "/continue_generation", {})
    t0 = time.perf_counter()
    generate(server, [0])
    own["one_token"] = time.perf_counter() - t0
    own["resume_plus_token"] = own["resume"] + own["one_token"]
    return own


def test_agent_drives_real_sglang(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    server, tmp, model = real
    procs: list[Proc] = []
    seen: dict[str, Any] = {"iterations": [], "own": []}
    try:
        _drive(server, tmp, model, results_dir, procs, seen)
    except BaseException:
        # What the iterations that ran saw, and every process's log, for a run that did not finish.
        (results_dir / "real_sglang_partial.json").write_text(json.dumps(seen, indent=1, default=str))
        for p in procs:
            (results_dir / f"partial_{p.name}.log").write_text(p.log_text()[-400_000:])
        raise
    finally:
        for p in reversed(procs):
            p.stop()


def _drive(
    server: RealSGLang,
    tmp: Path,
    model: TinyLlama,
    results_dir: Path,
    procs: list[Proc],
    seen: dict[str, Any],
) -> None:
    launch = tmp / "v0"
    fixed = {"fixed": tokens("question: what is the capital of france? the capital of france is", launch)}
    cached = {
        f"cached-{i}": tokens(f"iteration {i}: the model weights of the rollout are", launch)
        for i in range(1, 4)
    }
    prompts_file = tmp / "prompts.json"
    prompts_file.write_text(json.dumps(fixed | cached))
    floor_file = tmp / "floor.json"
    flight_prompts = [tokens(f"request {k} in flight", launch) for k in range(IN_FLIGHT)]
    # The weights SGLang's own iterations load (seeds far from the agent's).
    own_ckpts = [model.write(tmp / f"own-{j}", seed=900 + j) for j in range(len(PLAN))]

    # The record on tmpfs, as the chart's emptyDir (medium: Memory) holds it in a pod.
    state_dir = Path(
        tempfile.mkdtemp(prefix="rljob-agent-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    agent = Agent(tmp, server.url, "--state-dir", str(state_dir), probe="nvml")
    procs.append(agent)
    agent.wait_stage("Ready", timeout=120)
    c = AgentDriver(agent)
    opening = seen["opening"] = c.done("resume", 60)
    trainer = Proc(
        "real-trainer",
        [PY, str(HERE / "real_trainer.py"), "--plan", ",".join(PLAN), "--model-dir", str(launch),
         "--weights-dir", str(tmp / "ckpt"), "--seed-base", str(TRAINER_SEED_BASE),
         "--prompts", str(prompts_file), "--floor-bytes-file", str(floor_file),
         "--result-dir", str(tmp / "trainer")],
        tmp / "real-trainer.log",
        env={"RLJOB_AGENT_URL": agent.trainer_url},
    )  # fmt: skip
    procs.append(trainer)
    total = nvml_total()
    iterations: list[dict[str, Any]] = seen["iterations"]
    own: list[dict[str, float]] = seen["own"]
    served_version = "0"
    for i, kind in enumerate(PLAN):
        version = str(1 + i)
        it: dict[str, Any] = {"kind": kind, "version": version}
        iterations.append(it)
        # The prompt served (and cached) before the refit.
        before = generate(
            server, cached[f"cached-{i + 1}"], sampling_params={"max_new_tokens": 4, "temperature": 0.0}
        )
        again = generate(
            server, cached[f"cached-{i + 1}"], sampling_params={"max_new_tokens": 4, "temperature": 0.0}
        )
        assert before["meta_info"]["weight_version"] == served_version
        it["cached_tokens_before_refit"] = again["meta_info"]["cached_tokens"]
        assert it["cached_tokens_before_refit"] > 0, (
            "the prefix cache did not hold the prompt: the check below proves nothing"
        )

        agent.wait_state(
            while_alive(trainer, lambda s: s["trainer"]["requested"]), 300, "the trainer to ask for the GPU"
        )
        flight = InFlight(server, flight_prompts)
        wait_running(server, IN_FLIGHT)
        it["used_before_release"] = nvml_used()
        it["drain"] = c.done("drain", 60)
        it["in_flight_ended"] = flight.join()
        assert set(it["in_flight_ended"]) == {"abort"}, it["in_flight_ended"]
        it["release"] = c.done("release", 120, tags=ALL_TAGS)
        it["used_after_release"] = nvml_used()
        it["nvml_freed"] = it["used_before_release"] - it["used_after_release"]
        memory = agent.state()["memory"]
        assert memory["verified"] and memory["freedBytes"] > 0, memory
        it["agent_freed"] = memory["freedBytes"]
        if i == 0:
            floor_file.write_text(json.dumps({"bytes": it["agent_freed"]}))
        it["grant"] = c.done("grant", 30)
        st = agent.wait_state(
            while_alive(trainer, lambda s: s["stage"] == "Trained"), 600, "the trainer to publish"
        )
        assert st["trainer"]["publishedVersion"] == version
        if kind == "tensor":
            it["refit"] = c.done("refit", 300, version=version, source="tensor")
        else:
            it["refit"] = c.done("refit", 300, version=version, path=st["trainer"]["publishedPath"])
        it["resume"] = c.done("resume", 60)
        served_version = version
        assert agent.state()["sglang"]["servedVersion"] == version
        ref = json.loads((tmp / "trainer" / f"reference-{version}.json").read_text())
        prev = None
        if i > 0:
            prev = json.loads((tmp / "trainer" / f"reference-{int(version) - 1}.json").read_text())
        it |= verify_refit(server, fixed | cached, f"cached-{i + 1}", version, ref, prev)
        # SGLang's own calls for the same phases, the agent idle meanwhile; then SGLang is put back on the
        # agent's version (the weights the trainer made for it), as the agent left it.
        own.append(sglang_own_iteration(server, own_ckpts[i], f"own-{i}", flight_prompts))
        restore = model.write(tmp / f"restore-{version}", seed=TRAINER_SEED_BASE + i)
        r = server.call(
            "POST", "/update_weights_from_disk", {"model_path": str(restore), "weight_version": version}
        )
        assert r.status == 200 and r.body["success"], r.text
    trainer.wait_exit(120)
    assert trainer.returncode() == 0, trainer.log_text()[-4000:]
    assert server.alive(), "SGLang exited"
    tr = [json.loads((tmp / "trainer" / f"iteration-{i}.json").read_text()) for i in range(len(PLAN))]
    report = summarize(server, opening, iterations, own, tr, total)
    (results_dir / "real_sglang.json").write_text(json.dumps(report, indent=1))
    (results_dir / "real_sglang.md").write_text(report["markdown"])
    (results_dir / "real_sglang_agent.log").write_text(agent.log_text()[-400_000:])
    print("\n" + report["markdown"])
    for it, t in zip(iterations, tr, strict=True):
        assert t["occupy"]["allocated"] > total - it["used_before_release"], (
            t["occupy"],
            it["used_before_release"],
        )


def summarize(
    server: RealSGLang,
    opening: dict[str, Any],
    iterations: list[dict[str, Any]],
    own: list[dict[str, float]],
    tr: list[dict[str, Any]],
    total: int,
) -> dict[str, Any]:
    rows = []
    for i, (it, o) in enumerate(zip(iterations, own, strict=True)):
        for phase, own_key in (
            ("drain", "drain"),
            ("release", "release"),
            ("refit", "refit"),
            ("resume", "resume_plus_token"),
        ):
            agent_s = it[phase]["seconds"]
            rows.append([str(i + 1), it["kind"] if phase == "refit" else "", phase, f"{agent_s * 1e3:.1f}",
                         f"{(it[phase]['sglangSeconds'] or 0) * 1e3:.1f}", f"{o[own_key] * 1e3:.1f}",
                         f"{agent_s / o[own_key]:.2f}"])  # fmt: skip
    phases = markdown_table(
        ["iter", "refit", "phase", "agent ms", "in SGLang ms", "SGLang's own ms", "ratio"], rows
    )
    mem_rows = [
        [
            str(i + 1),
            f"{_gib(it['nvml_freed'])}",
            f"{_gib(it['agent_freed'])}",
            f"{_gib(total - it['used_before_release'])}",
            f"{_gib(t['occupy']['free_at_grant'])}",
            f"{_gib(t['occupy']['allocated'])}",
            f"{it['logprob_max_abs_diff']:.4f}",
            str(it["cached_tokens_before_refit"]),
            str(it["cached_tokens_after_refit"]),
        ]
        for i, (it, t) in enumerate(zip(iterations, tr, strict=True))
    ]
    memory = markdown_table(
        ["iter", "NVML freed GiB", "agent freed GiB", "free before release GiB", "free at grant GiB",
         "trainer allocated GiB", "max |Δ logprob|", "cached before", "cached after"],
        mem_rows,
    )  # fmt: skip
    floor = tr[0]["tms_floor"]
    pause_ms = statistics.median(floor["pause_seconds"]) * 1e3
    resume_ms = statistics.median(floor["resume_seconds"]) * 1e3
    tensors = [t for t in tr if t["kind"] == "tensor"]
    text = "\n".join(
        [
            f"Real SGLang {VERSION}, start {server.start_seconds:.1f} s, flags {' '.join(LAUNCH_FLAGS)}",
            "",
            phases,
            "",
            memory,
            "",
            f"torch_memory_saver floor ({_gib(floor['bytes'])} GiB region): pause {pause_ms:.1f} ms, "
            f"resume {resume_ms:.1f} ms",
        ]
        + [
            f"tensor push {t['push_bytes'] / 2**20:.1f} MiB: window {t['window_seconds'] * 1e3:.1f} ms, "
            f"device copy of the same bytes {t['d2d_copy_seconds'] * 1e3:.2f} ms"
            for t in tensors
        ]
    )
    return {
        "version": VERSION,
        "start_seconds": server.start_seconds,
        "opening_resume": opening,
        "iterations": iterations,
        "own": own,
        "trainer": tr,
        "gpu_total": total,
        "markdown": text + "\n",
    }


# --- where a release's time goes ---------------------------------------------------------------------

RELEASE_ROUNDS = 3


def agents_drain_then_release(server: RealSGLang, prompts: list[list[int]], settle_s: float) -> float:
    """The agent's calls, made here: abort, flush until idle, pause, the idle re-check, then (after
    `settle_s`) the release, timed alone; then everything back for the next round."""
    flight = InFlight(server, prompts)
    wait_running(server, IN_FLIGHT)
    timed(server, "POST", "/abort_request", {"abort_all": True})
    while server.call("POST", "/flush_cache").status != 200:
        time.sleep(0.005)
    timed(server, "POST", "/pause_generation", {"mode": "abort"})
    assert set(flight.join()) == {"abort"}
    timed(server, "POST", "/flush_cache")
    time.sleep(settle_s)
    seconds = timed(server, "POST", "/release_memory_occupation", {"tags": ALL_TAGS})
    timed(server, "POST", "/resume_memory_occupation", {"tags": ALL_TAGS})
    timed(server, "POST", "/continue_generation", {})
    return seconds


def test_release_right_after_a_drain(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    """SGLang's release call alone, right after the agent's drain (as the agent sends it) and 1 s later
    (as after SGLang's own abort pause, which sleeps 1 s): whether a release costs more when it follows
    the requests' abort closely. Figures: $RLJOB_GPU_RESULTS_DIR/release_after_drain.json."""
    server, tmp, _ = real
    prompts = [tokens(f"request {k} in flight", tmp / "v0") for k in range(IN_FLIGHT)]
    rounds: dict[str, list[float]] = {"at once": [], "1 s later": []}
    for _ in range(RELEASE_ROUNDS):
        rounds["at once"].append(agents_drain_then_release(server, prompts, 0.0))
        rounds["1 s later"].append(agents_drain_then_release(server, prompts, 1.0))
    (results_dir / "release_after_drain.json").write_text(json.dumps(rounds, indent=1))
    print("\nrelease call ms after the drain: " + "; ".join(
        f"{k}: {', '.join(f'{x * 1e3:.1f}' for x in v)}" for k, v in rounds.items()
    ))  # fmt: skip
    assert server.alive()


# --- the emulator held to the real server ---------------------------------------------------------------


def _differential(
    real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path, fatal: bool
) -> list[dict[str, Any]]:
    """The sequences (the fatal ones, or the others) to the emulator and to real SGLang; the real answers
    are added to $RLJOB_GPU_RESULTS_DIR/real-<version>.json and the table to differential.md."""
    server, tmp, _ = real
    launch = tmp / "v0"
    sequences, left_out = differential.load_sequences(
        DIFFERENTIAL / "sequences.json", ROOT / "tests" / "replays", LAUNCH_FLAGS
    )
    sequences = [s for s in sequences if bool(s.get("fatal")) == fatal]
    emu = Emulator(
        tmp, VERSION, *LAUNCH_FLAGS, "--model-path", str(launch), memory_saver=False, tps=EMULATOR_TPS
    )
    try:
        emu.wait_ready(60)
        emu_obs = differential.run_all(
            emu.url, emu.alive, sequences, VERSION, differential.contexts(tmp / f"emu-{fatal}", launch)
        )
    finally:
        emu.stop()
    real_ctx = differential.contexts(tmp / f"real-{fatal}", launch, real_payloads.BUILDERS)
    real_obs = differential.run_all(server.url, server.alive, sequences, VERSION, real_ctx)
    record_file = results_dir / f"real-{VERSION}.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {
        "version": VERSION, "launch_flags": list(LAUNCH_FLAGS), "emulator_tps": EMULATOR_TPS,
        "left_out": left_out, "sequences": [],
    }  # fmt: skip
    record["sequences"] += real_obs
    record_file.write_text(json.dumps(record, indent=1))
    emu_file = results_dir / f"emulator-{VERSION}.json"
    emulated = json.loads(emu_file.read_text())["sequences"] if emu_file.exists() else []
    emu_file.write_text(json.dumps({"sequences": emulated + emu_obs}, indent=1))
    text = differential.table(
        record["sequences"],
        emulated + emu_obs,
        differential.recorded(DIFFERENTIAL / "known-differences.json"),
    )
    text += "".join(f"- {name}: not sent, {why}\n" for name, why in left_out.items())
    (results_dir / "differential.md").write_text(text)
    print("\n" + text)
    assert [o["name"] for o in real_obs] == [s["name"] for s in sequences], "a sequence was not sent"
    return real_obs


def test_differential(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    """Every sequence SGLang survives, to both servers (the table: differential.md)."""
    _differential(real, results_dir, fatal=False)
    assert real[0].alive()


# --- frameworks through the agent's endpoint -------------------------------------------------------------

FRAMEWORKS = (("slime", "tensor"), ("verl", "tensor"), ("areal", "disk"))
FRAMEWORK_ITERATIONS = 2


def conduct(agent: Agent, c: AgentDriver, trainer: Proc, source: str) -> dict[str, Any]:
    """The operator's part of one iteration for a framework behind the endpoint: its release is the lease
    request, its push (tensor) or disk update publishes, its resume waits for the pod to serve."""
    it: dict[str, Any] = {}
    agent.wait_state(
        while_alive(trainer, lambda s: s["trainer"]["requested"]), 300, "the framework's release"
    )
    it["drain"] = c.done("drain", 60)
    it["release"] = c.done("release", 120, tags=ALL_TAGS)
    it["grant"] = c.done("grant", 30)
    st = agent.wait_state(
        while_alive(trainer, lambda s: s["stage"] == "Trained"), 300, "the framework to publish"
    )
    version = st["trainer"]["publishedVersion"]
    fields = {"source": "tensor"} if source == "tensor" else {"path": st["trainer"]["publishedPath"]}
    it["refit"] = c.done("refit", 300, version=version, **fields)
    it["resume"] = c.done("resume", 60)
    it["version"] = agent.state()["sglang"]["servedVersion"]
    assert it["version"] == version
    return it


def test_frameworks_through_the_endpoint(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    """slime's, verl's and AReaL's recorded sequences (rljob.testing.framework_trainer, real CUDA tensors
    in their pushes) against the agent's SGLang-compatible endpoint in front of real SGLang, 2 iterations
    each, this test playing the operator; each framework's process exits 0 after its last resume."""
    from agent_procs import free_port

    server, tmp, _ = real
    # Back to the launch weights at version 0: slime names its versions 1, 2, ... (the others count on).
    back = {"model_path": str(tmp / "v0"), "weight_version": "0"}
    r = server.call("POST", "/update_weights_from_disk", back)
    assert r.status == 200 and r.body["success"], r.text
    report: dict[str, Any] = {}
    for name, source in FRAMEWORKS:
        procs: list[Proc] = []
        try:
            port = free_port()
            agent = Agent(tmp, server.url, "--engine-listen", f"127.0.0.1:{port}", probe="nvml")
            procs.append(agent)
            agent.wait_stage("Ready", timeout=120)
            c = AgentDriver(agent)
            c.done("resume", 60)
            replay = ROOT / "tests" / "replays" / f"{name}.json"
            env = {
                "RLJOB_ENGINE_URL": f"http://127.0.0.1:{port}",
                "RLJOB_WEIGHTS_DIR": str(tmp / f"{name}-w"),
            }
            fw = Proc(
                f"{name}-trainer",
                [PY, "-m", "rljob.testing.framework_trainer", "--replay", str(replay),
                 "--iterations", str(FRAMEWORK_ITERATIONS), "--real-payloads", "--step-timeout", "300"],
                tmp / f"{name}-trainer.log",
                env=env,
            )  # fmt: skip
            procs.append(fw)
            iterations = [conduct(agent, c, fw, source) for _ in range(FRAMEWORK_ITERATIONS)]
            assert fw.wait_exit(120) == 0, fw.log_text()[-4000:]
            steps = [json.loads(line) for line in fw.log_text().splitlines() if line.startswith("{")]
            report[name] = {"iterations": iterations, "steps": steps}
            (results_dir / f"framework_{name}.log").write_text(fw.log_text()[-200_000:])
        finally:
            for p in reversed(procs):
                p.stop()
        assert server.alive(), f"SGLang exited during {name}'s sequence"
    rows = []
    for name, rec in report.items():
        for i, it in enumerate(rec["iterations"]):
            ms = [f"{it[k]['seconds'] * 1e3:.1f}" for k in ("drain", "release", "refit", "resume")]
            rows.append([name, str(i + 1), it["version"], *ms])
    text = markdown_table(
        ["framework", "iter", "version", "drain ms", "release ms", "refit ms", "resume ms"], rows
    )
    (results_dir / "frameworks.json").write_text(json.dumps(report, indent=1))
    (results_dir / "frameworks.md").write_text(text + "\n")
    print("\n" + text)


def test_the_call_sglang_dies_on(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    """Last in this module: the fatal sequence (a release with a request in flight) ends real SGLang, and
    the emulator with it."""
    obs = _differential(real, results_dir, fatal=True)
    assert obs and not obs[-1]["alive_after"] and not real[0].alive()
