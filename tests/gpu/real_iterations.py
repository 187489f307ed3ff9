"""Iterations of real SGLang driven by the real agent (`--gpu-probe nvml`), with a real torch trainer
(real_trainer.py) in the memory SGLang releases: what test_real_sglang.py (the tiny model: the protocol)
and test_real_sglang_8b.py (Llama-3-8B shapes: the figures) both run.

Each iteration: a prompt served twice (cached), 3 requests in flight, drain (abort), release of every tag
verified by NVML, the grant, the trainer's publish, the refit (disk, or tensor through the SDK's CUDA-IPC
packing), the trainer giving its memory back, resume. Then the checks: the cached prompt is computed
anew (0 cached tokens) and its next token is the new weights'; the logprobs of fixed prompts moved from
the previous version's by more than VERSIONS_APART nats; with a reference (the tiny model) they equal a
transformers forward of the weights in the trainer (LOGPROB_TOLERANCE). Then SGLang's own calls for the
same phases with no agent (a tensor refit pushed by direct_push.py straight to SGLang, the same bytes),
and SGLang loading the version's checkpoint from disk, whose logprobs must equal those after the agent's
refit (SAME_WEIGHTS_TOLERANCE): the refit wrote exactly the version's weights."""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_procs import ALL_TAGS, PY, Agent, AgentDriver, Proc
from gpu_helpers import GiB, markdown_table, nvml_total, nvml_used, while_alive
from real_sglang import VERSION, RealSGLang, start_phases

HERE = Path(__file__).resolve().parent
IN_FLIGHT = 3
LONG = {"sampling_params": {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}}
TRAINER_SEED_BASE = 100  # real_trainer.py's --seed-base: iteration i pushes the version of seed 100 + i
# Nats per token, SGLang against the trainer's transformers forward: both bf16, other kernels. The logits
# (std ~3, the largest 8-16) sit 0.0625 apart in bf16: this is 4 such steps; two versions differ by more
# than 1 nat.
LOGPROB_TOLERANCE = 0.25
# SGLang against itself, the same weights loaded two ways (the agent's refit, its own disk load): the
# same kernels on the same input; a bf16 step of a large logit is 0.0625.
SAME_WEIGHTS_TOLERANCE = 0.1
VERSIONS_APART = 1.0  # nats: two versions' logprobs differ by more than this
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class Served:
    """A model real SGLang serves here: its launch checkpoint and how the trainer makes its versions."""

    name: str  # real_models.MODELS
    launch: Path
    root: Path | None = None  # the 8b model's root (holding base/)
    reference: bool = False  # the trainer computes transformers' logprobs (cheap for the tiny model only)

    def model_args(self) -> list[str]:
        args = ["--model", self.name] + (["--model-root", str(self.root)] if self.root else [])
        return args + (["--reference"] if self.reference else [])


def tokens(text: str, model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)


def generate(server: RealSGLang, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, **extra}
    r = server.call("POST", "/generate", body)
    assert r.status == 200, r.text
    return dict(r.body)


def served_logprobs(server: RealSGLang, ids: list[int]) -> dict[str, Any]:
    """SGLang's logprob of each token of `ids` after the first (computed anew: logprob_start_len 0), its
    greedy next token with its logprob, and the TOP_LOGPROBS best next tokens."""
    out = generate(server, ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=TOP_LOGPROBS)
    meta = out["meta_info"]
    ((next_lp, next_tok, *_),) = meta["output_token_logprobs"]
    (top,) = meta["output_top_logprobs"]
    return {
        "input_logprobs": [lp for lp, _tok, *_ in meta["input_token_logprobs"][1:]],
        "next_token": next_tok,
        "next_logprob": next_lp,
        "top": [[tok, lp] for lp, tok, *_ in top],
    }


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Nats: the largest difference of a token's logprob between two readings of one prompt."""
    pairs = [
        *zip(a["input_logprobs"], b["input_logprobs"], strict=True),
        (a["next_logprob"], b["next_logprob"]),
    ]
    return max(abs(x - y) for x, y in pairs)


def same_next_token(token: int, ref: dict[str, Any], tolerance: float) -> bool:
    """`token` is `ref`'s greedy next token, or ties with it within `tolerance` nats (a near tie may fall
    either way in other kernels)."""
    if token == ref["next_token"]:
        return True
    return any(t == token and ref["next_logprob"] - lp <= tolerance for t, lp in ref.get("top", []))


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


def timed(server: RealSGLang, method: str, path: str, body: Any = None) -> float:
    t0 = time.perf_counter()
    r = server.call(method, path, body)
    seconds = time.perf_counter() - t0
    assert r.status == 200, f"{path}: {r.status} {r.text}"
    if isinstance(r.body, dict) and "success" in r.body:
        assert r.body["success"] is True, r.body
    return seconds


def wait_file(path: Path, proc: Proc, timeout: float, what: str) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        rc = proc.returncode()
        assert rc in (None, 0), f"{proc.name} exited {rc}:\n{proc.log_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{what} not within {timeout}s:\n{proc.log_text()[-4000:]}"
        time.sleep(0.01)
    return path


class DirectPush:
    """direct_push.py for one version: started early (its imports are not SGLang's time), told to make
    the weights once SGLang released its memory, then to push."""

    def __init__(self, tmp: Path, server: RealSGLang, served: Served, seed: int, version: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"direct-{version}-", dir=tmp))
        self.result = self.dir / "result.json"
        argv = [PY, str(HERE / "direct_push.py"), "--url", server.url, "--model", served.name,
                "--seed", str(seed), "--version", version, "--signal-dir", str(self.dir),
                "--result", str(self.result)]  # fmt: skip
        if served.root is not None:
            argv += ["--model-root", str(served.root)]
        self.proc = Proc(f"direct-push-{version}", argv, self.dir / "direct-push.log")

    def make_weights(self) -> None:
        wait_file(self.dir / "started", self.proc, 300, "direct_push.py's start")
        (self.dir / "weights").write_text("")
        wait_file(self.dir / "ready", self.proc, 300, "direct_push.py's weights")

    def push(self) -> dict[str, Any]:
        (self.dir / "push").write_text("")
        rc = self.proc.wait_exit(300)
        assert rc == 0, self.proc.log_text()[-4000:]
        return dict(json.loads(self.result.read_text()))

    def stop(self) -> None:
        self.proc.stop()


def sglang_own_iteration(
    server: RealSGLang,
    kind: str,
    ckpt: Path,
    label: str,
    prompts: list[list[int]],
    direct: DirectPush | None,
) -> dict[str, Any]:
    """One iteration of SGLang's own calls, no agent: what each phase's agent command is compared with. A
    tensor refit is `direct`'s push of the version's weights, a disk refit a load of `ckpt`."""
    flight = InFlight(server, prompts)
    wait_running(server, IN_FLIGHT)
    own: dict[str, Any] = {"drain": timed(server, "POST", "/pause_generation", {"mode": "abort"})}
    assert set(flight.join()) == {"abort"}
    own["release"] = timed(server, "POST", "/release_memory_occupation", {"tags": ALL_TAGS})
    if direct is not None:
        direct.make_weights()
    own["refit"] = timed(server, "POST", "/resume_memory_occupation", {"tags": ["cuda_graph", "weights"]})
    if direct is not None:
        own["push"] = direct.push()  # the process exited: its memory is the driver's again
        own["refit"] += own["push"]["reused"]["window_seconds"]
    else:
        body = {"model_path": str(ckpt), "weight_version": label}
        own["refit"] += timed(server, "POST", "/update_weights_from_disk", body)
    own["resume"] = timed(server, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    own["continue"] = timed(server, "POST", "/continue_generation", {})
    t0 = time.perf_counter()
    generate(server, [0])
    own["one_token"] = time.perf_counter() - t0
    own["resume_plus_token"] = own["resume"] + own["one_token"]
    own["kind"] = kind
    return own


def push_timings(agent_log: str) -> list[list[dict[str, Any]]]:
    """The agent's `tensor push timing` lines, one list per refit window (its pushes count from 1)."""
    windows: list[list[dict[str, Any]]] = []
    for line in agent_log.splitlines():
        _, sep, rest = line.partition("tensor push timing ")
        if sep:
            t = json.loads(rest)
            if t["push"] == 1 or not windows:
                windows.append([])
            windows[-1].append(t)
    return windows


def drive(
    server: RealSGLang,
    tmp: Path,
    served: Served,
    plan: tuple[str, ...],
    procs: list[Proc],
    seen: dict[str, Any],
    at_once: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The iterations of `plan` ("disk" or "tensor"); `at_once`: those where the trainer publishes as soon
    as it holds the lease. What they saw goes into `seen` as it happens (a partial run keeps it)."""
    launch = served.launch
    fixed = {"fixed": tokens("question: what is the capital of france? the capital of france is", launch)}
    cached = {
        f"cached-{i}": tokens(f"iteration {i}: the model weights of the rollout are", launch)
        for i in range(1, len(plan) + 1)
    }
    prompts = fixed | cached
    prompts_file = tmp / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    floor_file = tmp / "floor.json"
    flight_prompts = [tokens(f"request {k} in flight", launch) for k in range(IN_FLIGHT)]
    trainer_dir = tmp / "trainer"

    # The record on tmpfs, as the chart's emptyDir (medium: Memory) holds it in a pod.
    state_dir = Path(
        tempfile.mkdtemp(prefix="rljob-agent-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    agent = Agent(tmp, server.url, "--state-dir", str(state_dir), probe="nvml")
    procs.append(agent)
    agent.wait_stage("Ready", timeout=120)
    c = AgentDriver(agent)
    seen["opening"] = c.done("resume", 60)
    trainer = Proc(
        "real-trainer",
        [PY, str(HERE / "real_trainer.py"), "--plan", ",".join(plan), *served.model_args(),
         "--model-dir", str(launch), "--weights-dir", str(tmp / "ckpt"),
         "--seed-base", str(TRAINER_SEED_BASE), "--prompts", str(prompts_file),
         "--floor-bytes-file", str(floor_file), "--result-dir", str(trainer_dir),
         "--at-once", ",".join(map(str, at_once))],
        tmp / "real-trainer.log",
        env={"RLJOB_AGENT_URL": agent.trainer_url},
    )  # fmt: skip
    procs.append(trainer)
    seen["gpu_total"] = total = nvml_total()
    iterations: list[dict[str, Any]] = seen.setdefault("iterations", [])
    own: list[dict[str, Any]] = seen.setdefault("own", [])
    served_version, previous = "0", None
    for i, kind in enumerate(plan):
        version = str(1 + i)
        it: dict[str, Any] = {"kind": kind, "version": version, "at_once": i in at_once}
        iterations.append(it)
        cached_prompt = f"cached-{i + 1}"
        # The prompt served (and cached) before the refit.
        four = {"sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        before = generate(server, prompts[cached_prompt], **four)
        again = generate(server, prompts[cached_prompt], **four)
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
        # The trainer gives its memory back before SGLang resumes (its iteration file comes last).
        record = wait_file(trainer_dir / f"iteration-{i}.json", trainer, 300, "the trainer's memory back")
        it["resume"] = c.done("resume", 60)
        it["switching_seconds"] = sum(it[k]["seconds"] for k in ("drain", "release", "refit", "resume"))
        served_version = version
        assert agent.state()["engine"]["servedVersion"] == version
        it |= check_refit(server, prompts, cached_prompt, version, previous)
        if served.reference:
            ref = json.loads((trainer_dir / f"reference-{version}.json").read_text())
            it |= check_reference(it["served"], ref)
        previous = it["served"]
        # SGLang's own calls for the same phases, the agent idle meanwhile.
        trained = json.loads(record.read_text())
        ckpt = Path(trained["path"])
        direct = None
        if kind == "tensor":
            direct = DirectPush(tmp, server, served, TRAINER_SEED_BASE + i, f"own-{i}")
            procs.append(direct.proc)
        own.append(sglang_own_iteration(server, kind, ckpt, f"own-{i}", flight_prompts, direct))
        # Then SGLang loads the version's checkpoint itself, as `version` (the agent's record of what it
        # serves): the logprobs must be those the agent's refit gave.
        r = server.call(
            "POST", "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": version}
        )
        assert r.status == 200 and r.body["success"], r.text
        it |= check_same_weights(server, prompts, it["served"])
        o = own[-1]
        print(
            f"iteration {i + 1} ({kind}{', at once' if i in at_once else ''}): agent ms drain "
            f"{ms(it['drain']['seconds'])} release {ms(it['release']['seconds'])} refit "
            f"{ms(it['refit']['seconds'])} resume {ms(it['resume']['seconds'])}, switching "
            f"{ms(it['switching_seconds'])}; SGLang's own drain {ms(o['drain'])} release {ms(o['release'])} "
            f"refit {ms(o['refit'])} resume+token {ms(o['resume_plus_token'])}; vs own disk load "
            f"{it['same_weights_max_abs_diff']:.4f} nats, vs previous "
            f"{_nats(it.get('previous_version_diff'))}",
            flush=True,
        )
    trainer.wait_exit(120)
    assert trainer.returncode() == 0, trainer.log_text()[-4000:]
    assert server.alive(), "SGLang exited"
    seen["trainer"] = [
        json.loads((trainer_dir / f"iteration-{i}.json").read_text()) for i in range(len(plan))
    ]
    seen["pushes"] = push_timings(agent.log_text())
    for it, t in zip(iterations, seen["trainer"], strict=True):
        if "occupy" in t:  # the trainer allocated more than was free before the release
            assert t["occupy"]["allocated"] > total - it["used_before_release"], (t["occupy"], it)
    return seen


def check_refit(
    server: RealSGLang,
    prompts: dict[str, list[int]],
    cached: str,
    version: str,
    previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """After a refit to `version`: no stale KV (the prompt `cached` was served and cached before the refit;
    now it is computed anew, its next token the new weights'), and the logprobs moved from the previous
    version's."""
    out: dict[str, Any] = {}
    after = generate(server, prompts[cached])
    out["cached_tokens_after_refit"] = after["meta_info"]["cached_tokens"]
    assert out["cached_tokens_after_refit"] == 0, after["meta_info"]
    assert after["meta_info"]["weight_version"] == version
    out["served"] = {name: served_logprobs(server, ids) for name, ids in prompts.items()}
    token = after["output_ids"][0]
    assert same_next_token(token, out["served"][cached], SAME_WEIGHTS_TOLERANCE), (
        token,
        out["served"][cached],
    )
    if previous is not None:
        out["previous_version_diff"] = max_diff(out["served"]["fixed"], previous["fixed"])
        assert out["previous_version_diff"] > VERSIONS_APART, "the previous version's logprobs are as close"
    return out


def check_reference(served: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """SGLang's logprobs against transformers' forward of the same weights in the trainer."""
    diffs = {name: max_diff(s, ref[name]) for name, s in served.items()}
    worst = max(diffs.values())
    assert worst <= LOGPROB_TOLERANCE, diffs
    for name, s in served.items():
        assert same_next_token(s["next_token"], ref[name], LOGPROB_TOLERANCE), (name, s, ref[name])
    return {"logprob_max_abs_diff": worst}


def check_same_weights(
    server: RealSGLang, prompts: dict[str, list[int]], served: dict[str, Any]
) -> dict[str, Any]:
    """SGLang's logprobs now (the version's checkpoint loaded from disk) against those after the refit."""
    again = {name: served_logprobs(server, ids) for name, ids in prompts.items()}
    worst = max(max_diff(again[n], served[n]) for n in prompts)
    assert worst <= SAME_WEIGHTS_TOLERANCE, (worst, again, served)
    for n in prompts:
        assert same_next_token(served[n]["next_token"], again[n], SAME_WEIGHTS_TOLERANCE), (n, again[n])
    return {"same_weights_max_abs_diff": worst}


# --- the figures -------------------------------------------------------------------------------------


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _nats(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def summarize(
    server: RealSGLang, seen: dict[str, Any], floor: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run's tables: each agent command against SGLang's own calls, the switching cost, the memory, and
    each tensor push's parts against the CUDA-IPC floor of the same bytes (`floor`: ipc_floor.py's)."""
    iterations, own, tr = seen["iterations"], seen["own"], seen["trainer"]
    total = seen["gpu_total"]
    rows = []
    for i, (it, o) in enumerate(zip(iterations, own, strict=True)):
        for phase, own_key in (("drain", "drain"), ("release", "release"), ("refit", "refit"),
                               ("resume", "resume_plus_token")):  # fmt: skip
            agent_s = it[phase]["seconds"]
            in_sglang = it[phase]["engineSeconds"] or 0
            rows.append([str(i + 1), it["kind"] if phase == "refit" else "", phase, ms(agent_s),
                         ms(in_sglang), ms(o[own_key]), f"{agent_s / o[own_key]:.2f}"])  # fmt: skip
        own_switch = o["drain"] + o["release"] + o["refit"] + o["resume_plus_token"]
        rows.append([str(i + 1), it["kind"], "**switching**", ms(it["switching_seconds"]), "", ms(own_switch),
                     f"{it['switching_seconds'] / own_switch:.2f}"])  # fmt: skip
    phases = markdown_table(
        ["iter", "refit", "phase", "agent ms", "in SGLang ms", "SGLang's own ms", "ratio"], rows
    )
    mem_rows = [
        [str(i + 1), _gib(it["nvml_freed"]), _gib(it["agent_freed"]), _gib(total - it["used_before_release"]),
         _gib(t["occupy"]["free_at_grant"]) if "occupy" in t else "-",
         _gib(t["occupy"]["allocated"]) if "occupy" in t else "-",
         _nats(it.get("logprob_max_abs_diff")), _nats(it["same_weights_max_abs_diff"]),
         _nats(it.get("previous_version_diff")),
         str(it["cached_tokens_before_refit"]), str(it["cached_tokens_after_refit"])]
        for i, (it, t) in enumerate(zip(iterations, tr, strict=True))
    ]  # fmt: skip
    memory = markdown_table(
        ["iter", "NVML freed GiB", "agent freed GiB", "free before release GiB", "free at grant GiB",
         "trainer allocated GiB", "vs transformers nats", "vs own disk load nats", "vs previous nats",
         "cached before", "cached after"],
        mem_rows,
    )  # fmt: skip
    pushes = push_breakdown(seen, floor)
    lines = [
        f"Real SGLang {VERSION}, cold start {server.start_seconds:.1f} s, flags {' '.join(server.flags)}",
        *[f"  {line}" for line in start_phases(server.log_text())],
        "",
        phases,
        "",
        memory,
        "",
        pushes["markdown"],
    ]
    floors = [t["tms_floor"] for t in tr if "tms_floor" in t]
    if floors:
        f = floors[0]
        lines.append(
            f"torch_memory_saver floor ({_gib(f['bytes'])} GiB region): pause "
            f"{statistics.median(f['pause_seconds']) * 1e3:.1f} ms, resume "
            f"{statistics.median(f['resume_seconds']) * 1e3:.1f} ms"
        )
    goals = goals_met(seen, pushes)
    lines += ["", "Goals: " + "; ".join(goals)]
    return {
        "version": VERSION,
        "start_seconds": server.start_seconds,
        "start_phases": start_phases(server.log_text()),
        "flags": list(server.flags),
        "opening_resume": seen.get("opening"),
        "iterations": iterations,
        "own": own,
        "trainer": tr,
        "pushes": pushes["rows"],
        "ipc_floor": floor,
        "gpu_total": total,
        "goals": goals,
        "markdown": "\n".join(lines) + "\n",
    }


def floor_seconds(floor: dict[str, Any] | None, nbytes: int) -> float | None:
    """The CUDA-IPC floor of a push of `nbytes` (SGLang's way: the mapping dropped after each bucket,
    buckets reused): the median of ipc_floor.py's reused drop rounds, of the first bucket size measured."""
    if floor is None or floor.get("bytes") != nbytes:
        return None
    size = next(k for k in floor if k.endswith("MiB"))
    return statistics.median(floor[size][r]["seconds"] for r in ("drop_reused_1", "drop_reused_2"))


def push_breakdown(seen: dict[str, Any], floor: dict[str, Any] | None) -> dict[str, Any]:
    """Per tensor refit: the trainer's window and where it went (packing, serializing, the hop to the agent,
    the agent's checks, its call to SGLang), SGLang's own push of the same weights (straight, no agent) with
    its scheduler's load time, and the CUDA-IPC floor of the same bytes."""
    rows, out = [], []
    windows = iter(seen.get("pushes", []))
    for i, (it, t, o) in enumerate(zip(seen["iterations"], seen["trainer"], seen["own"], strict=True)):
        if it["kind"] != "tensor":
            continue
        agent_pushes = next(windows, [])
        rep = t["report"]
        send = sum(rep["send_seconds"])
        check = sum(p["check_s"] for p in agent_pushes)
        call = sum(p["engine_s"] for p in agent_pushes)
        direct = o.get("push", {})
        reused, instrumented = direct.get("reused", {}), direct.get("instrumented", {})
        loads = [x for x in instrumented.get("weight_load_seconds", []) if x is not None]
        fl = floor_seconds(floor, rep["bytes"])
        row = {
            "iteration": i + 1,
            "at_once": it["at_once"],
            "bytes": rep["bytes"],
            "buckets": rep["buckets"],
            "new_buffers": rep["new_buffers"],
            "window_seconds": t["window_seconds"],
            "window_wait_seconds": t["window_wait_seconds"],
            "pack_seconds": rep["pack_seconds"],
            "serialize_seconds": rep["serialize_seconds"],
            "send_seconds": send,
            "agent_check_seconds": check,
            "agent_sglang_call_seconds": call,
            "trainer_agent_hop_seconds": send - check - call,
            "direct_window_seconds": reused.get("window_seconds"),
            "direct_cold_window_seconds": direct.get("cold", {}).get("window_seconds"),
            "direct_send_seconds": sum(reused.get("send_seconds", [])) or None,
            "sglang_load_seconds": sum(loads) if loads else None,
            "ipc_floor_seconds": fl,
            "refit_command_seconds": it["refit"]["seconds"],
        }
        row["window_over_floor"] = row["window_seconds"] / fl if fl else None
        out.append(row)
        rows.append([
            str(i + 1), "at once" if it["at_once"] else "after training",
            f"{rep['bytes'] / GiB:.2f} GiB / {rep['buckets']}", "cold" if rep["new_buffers"] else "reused",
            ms(row["window_seconds"]), ms(row["pack_seconds"]), ms(row["serialize_seconds"]),
            ms(row["trainer_agent_hop_seconds"]), ms(check), ms(call), ms(row["sglang_load_seconds"]),
            ms(row["direct_window_seconds"]), ms(fl),
            "-" if row["window_over_floor"] is None else f"{row['window_over_floor']:.2f}x",
            ms(row["refit_command_seconds"]),
        ])  # fmt: skip
    table = markdown_table(
        ["iter", "lease", "bytes / buckets", "buffers", "window ms", "pack", "serialize",
         "hop trainer-agent", "agent checks", "agent-SGLang call", "of it SGLang's load", "SGLang's own push",
         "IPC floor", "window / floor", "refit command ms"],
        rows,
    )  # fmt: skip
    note = (
        "window: the trainer's first bucket packed to the last push answered; pack and serialize overlap the "
        "previous push in flight. hop trainer-agent: the trainer's round trips less the agent's checks and "
        "its call to SGLang. SGLang's load: its scheduler's update time "
        "(sglang:weight_load_duration_seconds) "
        "summed over the buckets of the same weights pushed straight to it. SGLang's own push: the same "
        "weights pushed straight to SGLang, no agent, buffers reused (a refit earlier in the same "
        "process). IPC floor: plain torch, two processes, the same bytes in buckets of the same size, the "
        "mapping dropped after each (tests/gpu/ipc_floor.py)."
    )
    return {"rows": out, "markdown": f"{table}\n\n{note}"}


def goals_met(seen: dict[str, Any], pushes: dict[str, Any]) -> list[str]:
    """Each goal of the figures with what this run measured, met or not (printed, never asserted)."""
    out = []
    tensor = [it for it in seen["iterations"] if it["kind"] == "tensor"]
    if tensor:
        worst = max(it["switching_seconds"] for it in tensor)
        out.append(f"switching with a tensor refit <= 0.15 s: {worst:.3f} s at most, {_met(worst <= 0.15)}")
    ratios = [r["window_over_floor"] for r in pushes["rows"] if r["window_over_floor"] is not None]
    if ratios:
        out.append(f"push <= 1.5x the IPC floor: {max(ratios):.2f}x at most, {_met(max(ratios) <= 1.5)}")
    disk = [(it, o) for it, o in zip(seen["iterations"], seen["own"], strict=True) if it["kind"] == "disk"]
    if disk:
        worst = max(it["refit"]["seconds"] / o["refit"] for it, o in disk)
        out.append(f"disk refit <= 1.02x SGLang's own: {worst:.3f}x at most, {_met(worst <= 1.02)}")
    first = [r for r in pushes["rows"] if r["new_buffers"]]
    others = [r for r in pushes["rows"] if not r["new_buffers"]]
    if first and others:
        ratio = first[0]["window_seconds"] / statistics.median(r["window_seconds"] for r in others)
        out.append(f"first push of the run (at once: {first[0]['at_once']}) / the others: {ratio:.2f}x")
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
