"""Iterations of vLLM driven by the real agent (`--engine vllm`), with a trainer through rljob.trainer: what
test_real_vllm.py runs against real vLLM 0.26.0 on a GPU (real_trainer.py, `--gpu-probe nvml`) or, on CPU,
against the vLLM emulator (vllm_stand_in_trainer.py, the emulator's probe).

Each iteration: a prompt served twice (the second a prefix-cache hit), 3 requests in flight, drain (abort:
each ends `abort`), release (level-2 sleep) verified by the agent's probe, the grant, the trainer's publish,
the refit (disk: reload_weights; tensor: the IPC weight transfer of the SDK's packed buckets), resume. Then:
the prompt served before the refit is no prefix-cache hit (vLLM's own counter, /metrics), and with a
reference (the tiny model on a GPU) the prompt logprobs of fixed prompts equal the trainer's transformers
forward (LOGPROB_TOLERANCE, the SGLang tier's). Then vLLM's own calls for the same phases with no agent,
timed, each agent command against them in the table. What was seen goes into `seen` as it happens and is
written under the results directory after each iteration."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_procs import Agent, AgentDriver, Proc
from gpu_helpers import markdown_table, while_alive

HERE = Path(__file__).resolve().parent
IN_FLIGHT = 3
LOGPROB_TOLERANCE = 0.25  # test_real_sglang's (real_iterations.LOGPROB_TOLERANCE): nats per token, bf16
RATIO_GOAL = 1.05
TAGS = ["kv_cache", "weights"]


def complete(server: Any, ids: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0.0, **extra}
    r = server.call("POST", "/v1/completions", body)
    assert r.status == 200, r.text
    return dict(r.body)


def metric(server: Any, name: str) -> float:
    """The sum of a /metrics sample's values over its label sets (one engine here)."""
    total, found = 0.0, False
    for line in server.call("GET", "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"no {name} in /metrics"
    return total


def prefix_hits(server: Any, ids: list[int]) -> float:
    """Prompt tokens vLLM served from its prefix cache for one request of `ids`."""
    before = metric(server, "vllm:prefix_cache_hits_total")
    complete(server, ids)
    return metric(server, "vllm:prefix_cache_hits_total") - before


def prompt_logprobs(server: Any, ids: list[int]) -> dict[str, Any]:
    """vLLM's logprob of each token of `ids` after the first (`prompt_logprobs`), and its greedy next
    token with its logprob."""
    out = complete(server, ids, prompt_logprobs=0, logprobs=5, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    lps = []
    for tok, entry in zip(ids[1:], choice["prompt_logprobs"][1:], strict=True):
        lps.append(float(entry[str(tok)]["logprob"]))
    top = choice["logprobs"]["top_logprobs"][0]
    nxt = choice["logprobs"]["tokens"][0]
    return {
        "input_logprobs": lps,
        "next_token": int(nxt.removeprefix("token_id:")),
        "next_logprob": float(choice["logprobs"]["token_logprobs"][0]),
        "top": [[int(k.removeprefix("token_id:")), float(v)] for k, v in top.items()],
    }


class InFlight:
    """Long generations started before a drain: each must end (aborted) when the drain returns."""

    def __init__(self, server: Any, prompts: list[list[int]]) -> None:
        self.reasons: list[str] = []

        def one(ids: list[int]) -> None:
            body = {"prompt": ids, "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
            r = server.call("POST", "/v1/completions", body, timeout=300)
            self.reasons.append(r.body["choices"][0]["finish_reason"] if r.status == 200 else f"{r.status}")

        self.threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 30
        while metric(server, "vllm:num_requests_running") < len(prompts):
            assert time.monotonic() < deadline, "the requests did not start running"
            time.sleep(0.02)

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(60)
        return self.reasons


def timed(server: Any, method: str, path: str, body: Any = None) -> float:
    t0 = time.perf_counter()
    r = server.call(method, path, body)
    seconds = time.perf_counter() - t0
    assert r.status == 200, f"{path}: {r.status} {r.text}"
    return seconds


def own_iteration(server: Any, ckpt: Path, prompts: list[list[int]]) -> dict[str, float]:
    """vLLM's own calls for one iteration, no agent: the drain (pause, abort), the release (level-2 sleep),
    the refit (weights woken, reload_weights from `ckpt`), the resume (KV cache woken, prefix cache reset,
    resume), and the first token after it."""
    flight = InFlight(server, prompts)
    own = {"drain": timed(server, "POST", "/pause?mode=abort")}
    assert set(flight.join()) == {"abort"}, flight.reasons
    own["release"] = timed(server, "POST", "/sleep?level=2")
    own["refit"] = timed(server, "POST", "/wake_up?tags=weights")
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}}
    own["refit"] += timed(server, "POST", "/collective_rpc", body)
    own["resume"] = timed(server, "POST", "/wake_up?tags=kv_cache")
    own["resume"] += timed(server, "POST", "/reset_prefix_cache")
    own["resume"] += timed(server, "POST", "/resume")
    t0 = time.perf_counter()
    complete(server, prompts[0][:4])
    own["one_token"] = time.perf_counter() - t0
    return own


def drive(
    server: Any,
    tmp: Path,
    plan: tuple[str, ...],
    procs: list[Proc],
    seen: dict[str, Any],
    trainer_argv: Callable[[Path, Path], list[str]],
    prompts: dict[str, list[int]],
    flight_prompts: list[list[int]],
    probe: str,
    on_iteration: Callable[[dict[str, Any]], None],
    reference: bool,
) -> dict[str, Any]:
    """The iterations of `plan`; `trainer_argv(prompts_file, result_dir)` starts the trainer."""
    prompts_file = tmp / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    trainer_dir = tmp / "trainer"
    state_dir = Path(
        tempfile.mkdtemp(prefix="rljob-agent-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    agent = Agent(tmp, server.url, "--engine", "vllm", "--state-dir", str(state_dir), probe=probe)
    procs.append(agent)
    agent.wait_stage("Ready", timeout=120)
    c = AgentDriver(agent)
    seen["opening"] = c.done("resume", 60)
    trainer = Proc("trainer", trainer_argv(prompts_file, trainer_dir), tmp / "trainer.log",
                   env={"RLJOB_AGENT_URL": agent.trainer_url})  # fmt: skip
    procs.append(trainer)
    iterations: list[dict[str, Any]] = seen.setdefault("iterations", [])
    own: list[dict[str, Any]] = seen.setdefault("own", [])
    for i, kind in enumerate(plan):
        version = str(1 + i)
        it: dict[str, Any] = {"kind": kind, "version": version}
        iterations.append(it)
        cached = prompts[f"cached-{i + 1}"]
        complete(server, cached)
        it["hits_before_refit"] = prefix_hits(server, cached)
        assert it["hits_before_refit"] > 0, (
            "the prefix cache did not hold the prompt: the check proves nothing"
        )
        agent.wait_state(
            while_alive(trainer, lambda s: s["trainer"]["requested"]), 300, "the trainer's request"
        )
        flight = InFlight(server, flight_prompts)
        it["drain"] = c.done("drain", 60)
        it["in_flight_ended"] = flight.join()
        assert set(it["in_flight_ended"]) == {"abort"}, it["in_flight_ended"]
        it["release"] = c.done("release", 120, tags=TAGS)
        memory = agent.state()["memory"]
        assert memory["verified"] and memory["freedBytes"] > 0, memory
        it["freed_bytes"] = memory["freedBytes"]
        it["grant"] = c.done("grant", 30)
        st = agent.wait_state(while_alive(trainer, lambda s: s["stage"] == "Trained"), 600, "the publish")
        assert st["trainer"]["publishedVersion"] == version
        fields = {"source": "tensor"} if kind == "tensor" else {"path": st["trainer"]["publishedPath"]}
        it["refit"] = c.done("refit", 300, version=version, **fields)
        record = trainer_dir / f"iteration-{i}.json"
        deadline = time.monotonic() + 300
        while not record.exists():
            assert trainer.returncode() in (None, 0), trainer.log_text()[-4000:]
            assert time.monotonic() < deadline, "the trainer's memory back: " + trainer.log_text()[-4000:]
            time.sleep(0.01)
        it["resume"] = c.done("resume", 60)
        assert agent.state()["engine"]["servedVersion"] == version
        it["hits_after_refit"] = prefix_hits(server, cached)
        assert it["hits_after_refit"] == 0, f"a prompt cached before the refit hit the cache after it: {it}"
        if reference:
            ref = json.loads((trainer_dir / f"reference-{version}.json").read_text())
            served = {name: prompt_logprobs(server, ids) for name, ids in prompts.items()}
            diffs = {n: max_diff(served[n], ref[n]) for n in served}
            it["logprob_max_abs_diff"] = max(diffs.values())
            assert it["logprob_max_abs_diff"] <= LOGPROB_TOLERANCE, diffs
        ckpt = Path(json.loads(record.read_text())["path"])
        own.append(own_iteration(server, ckpt, flight_prompts))
        on_iteration(seen)
        print(f"iteration {i + 1} ({kind}): " + "; ".join(
            f"{p} agent {it[p]['seconds'] * 1e3:.1f} ms vs vLLM's own {own[-1][p] * 1e3:.1f} ms"
            for p in ("drain", "release", "refit", "resume")), flush=True)  # fmt: skip
    assert trainer.wait_exit(120) == 0, trainer.log_text()[-4000:]
    assert server.alive(), "vLLM exited"
    return seen


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    pairs = [
        *zip(a["input_logprobs"], b["input_logprobs"], strict=True),
        (a["next_logprob"], b["next_logprob"]),
    ]
    return max(abs(x - y) for x, y in pairs)


def table(seen: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Each agent command against vLLM's own calls for it in the same run, the ratio, and its goal."""
    rows, out = [], []
    for i, (it, own) in enumerate(zip(seen["iterations"], seen["own"], strict=False)):
        for phase in ("drain", "release", "refit", "resume"):
            agent_s = it[phase]["seconds"]
            own_s = own[phase] + (own["one_token"] if phase == "resume" else 0)
            ratio = agent_s / own_s if own_s else None
            note = (
                "own: reload_weights from the same version's checkpoint"
                if phase == "refit" and it["kind"] == "tensor"
                else ""
            )
            engine_s = it[phase].get("engineSeconds")
            out.append({"iteration": i + 1, "kind": it["kind"], "phase": phase, "agent_s": agent_s,
                        "engine_s": engine_s, "own_s": own_s, "ratio": ratio})  # fmt: skip
            met = "-" if ratio is None else ("met" if ratio <= RATIO_GOAL else "NOT met")
            shown = "-" if ratio is None else f"{ratio:.2f}"
            kind = it["kind"] if phase == "refit" else ""
            rows.append(
                [str(i + 1), kind, phase, f"{agent_s * 1e3:.1f}", f"{own_s * 1e3:.1f}", shown, met, note]
            )
    text = markdown_table(["iter", "refit", "phase", "agent ms", "vLLM's own ms", "ratio",
                           f"<= {RATIO_GOAL}x", "note"], rows)  # fmt: skip
    return text, out
