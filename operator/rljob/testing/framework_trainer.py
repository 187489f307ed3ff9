"""A trainer that sends what slime, verl or AReaL sends to SGLang in one colocated iteration, replayed from
the recorded sequence (tests/replays/<framework>.json: bodies byte for byte, each step cited
path:line@commit), against the agent's SGLang-compatible endpoint.

    python -m rljob.testing.framework_trainer --replay tests/replays/slime.json [--iterations N]
        [--last-call STEP]
    env: RLJOB_ENGINE_URL (the endpoint), RLJOB_ITERATIONS (N when --iterations is not given; 0: forever),
         RLJOB_WEIGHTS_DIR (where AReaL's disk checkpoints are written), RLJOB_POD_INDEX

It waits for the server as the framework does (the sequence's launch-wait step), then for i = 1..N runs
the framework's iteration: its rollout at the served weights, then its handoff (release ... resume), the
steps named per framework in ITERATIONS, a contiguous run of the recorded sequence. With --startup it first
sends AReaL's start-up offload and first onload (a lease that ends without weights); slime's startup
offload and slime's and verl's first weight sync are not sent: in an RLJob the pods start serving the
launch weights and iteration 1's handoff is the first. The final iteration stops at the framework's last
call (AReaL: its last refit; the onload after it belongs to a step it never runs), and the trainer exits 0;
`--last-call` names another step to stop after (a framework that ends in the middle of its handoff).

Only the version changes between iterations: slime names it (the push body's `weight_version`, recorded as
the rollout id; here i, and its rollout reads back i - 1 from iteration 2 on); verl and AReaL name none.
AReaL's `{{WEIGHTS_DIR}}` is a real checkpoint directory written for version i before the step that sends
it. Every other placeholder is built once, as tests/agent/test_client_replay.py builds it.

HTTP in the real framework, or its in-process call replayed over HTTP (the step's `wire` in the JSON):
- slime: every step is HTTP (requests for control, httpx through its router for the rollout).
- verl (HYBRID mode): the resume, tensor push and flush are HTTP; the rollout's /generate and the release
  `{"tags": ["kv_cache", "weights"]}` are in-process tokenizer_manager calls in its server actor, sent here
  as the HTTP routes that build the same request object, so the endpoint still sees the lease request.
  verl has no HTTP launch wait: the trainer waits until the endpoint accepts a TCP connection, sending
  nothing.
- AReaL: every step is HTTP (aiohttp; its health check with requests); the disk update is sent while the
  memory is released, and the resume carries no tags.

One JSON line per step on stdout (event, iteration, part, name, wire, status, seconds). A reply that fails
the step's `expect` exits 2 with the step's name, citation and the reply; exits 0 after the last
iteration's last call.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rljob.testing.client_replay import Answer, Context, Step, checkpoint_dir, load, run_step


@dataclass(frozen=True)
class Iteration:
    """One colocated iteration of a framework, as the names of its recorded steps, in order."""

    rollout: tuple[str, ...]
    handoff: tuple[str, ...]  # release ... the resume that brings the KV cache back
    launch_wait: str | None = None
    startup: tuple[str, ...] = ()  # sent once before iteration 1 with --startup (AReaL's offload, onload)
    last_call: str | None = None  # the framework's last call: the final iteration stops after it
    version_field: str | None = None  # the field of a handoff body that names the version
    version_read: str | None = None  # the reply field the rollout's expect checks against that version


ITERATIONS: dict[str, Iteration] = {
    # train.py's loop: rollout, offload (flush, release), train, onload weights, refit, onload the rest.
    "slime": Iteration(
        launch_wait="health_generate (launch wait)",
        rollout=(
            "generate (sample 0)",
            "generate (sample 1)",
            "abort_request (end of rollout)",
            "v1/loads (is the server idle?)",
        ),
        handoff=(
            "flush_cache (before release)",
            "release_memory_occupation (all tags)",
            "resume_memory_occupation ['weights']",
            "pause_generation",
            "flush_cache (before the refit)",
            "update_weights_from_tensor (weight_version 2)",
            "continue_generation",
            "resume_memory_occupation ['kv_cache', 'cuda_graph']",
        ),
        version_field="weight_version",
        version_read="meta_info.weight_version",
    ),
    # ray_trainer.py's step: generate (in-process), sleep (in-process release), then the weight sync.
    "verl": Iteration(
        rollout=("generate verl-0", "generate verl-1"),
        handoff=(
            "release_memory_occupation kv_cache+weights (sleep)",
            "resume_memory_occupation weights",
            "update_weights_from_tensor (one bucket)",
            "flush_cache",
            "resume_memory_occupation kv_cache",
        ),
    ),
    # rl_trainer.py's step: rollout, offload (pause, release), train, disk refit, next step's onload. Its
    # start-up offloads once and each step onloads first (502-504, 560-561); after its last step's refit
    # the trainer ends: no onload follows.
    "areal": Iteration(
        launch_wait="health (launch wait)",
        startup=(
            "pause_generation",
            "release_memory_occupation (no tags)",
            "resume_memory_occupation (tags unset)",
            "continue_generation",
        ),
        last_call="continue_generation (refit)",
        rollout=("generate (sample 0)", "generate (sample 1)"),
        handoff=(
            "pause_generation",
            "release_memory_occupation (no tags)",
            "pause_generation (refit)",
            "update_weights_from_disk",
            "continue_generation (refit)",
            "resume_memory_occupation (tags unset)",
            "continue_generation",
        ),
    ),
}


class StepFailed(Exception):
    """A reply the framework would not accept."""


def _index_after(steps: list[Step], name: str, start: int) -> int:
    for i in range(start, len(steps)):
        if steps[i]["name"] == name:
            return i
    raise ValueError(f"no step named {name!r} at or after step {start}")


def select(steps: list[Step], names: tuple[str, ...]) -> list[Step]:
    """The steps named `names`: the first of that name, each after the one before; they must be a contiguous
    run of the recorded sequence."""
    indices: list[int] = []
    for name in names:
        indices.append(_index_after(steps, name, indices[-1] + 1 if indices else 0))
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise ValueError(f"steps {indices} are not a contiguous run of the sequence")
    chosen = [steps[i] for i in indices]
    if any(s.get("background") or s.get("join") for s in chosen):
        raise ValueError("a concurrent (background) step in an iteration is not replayed here")
    return chosen


def with_version(body: str, field_name: str, version: str) -> str:
    """`body` with the value of its one `field_name` replaced by `version`, every other byte as recorded."""
    recorded = json.loads(body)[field_name]  # placeholders sit inside strings: the body parses as recorded
    for separator in (": ", ":"):
        old = f"{json.dumps(field_name)}{separator}{json.dumps(recorded)}"
        if body.count(old) == 1:
            return body.replace(old, f"{json.dumps(field_name)}{separator}{json.dumps(version)}")
    raise ValueError(f"{field_name} = {recorded!r} is not written once in {body[:200]}")


def at_version(step: Step, plan: Iteration, i: int, part: str) -> Step:
    """`step` as iteration `i` sends and checks it: the version substituted where the framework names one."""
    body = step.get("body")
    if part == "handoff" and plan.version_field and body and plan.version_field in json.loads(body):
        return {**step, "body": with_version(body, plan.version_field, str(i))}
    equals = dict(step.get("expect", {}).get("equals", {}))
    if part == "rollout" and plan.version_read is not None and plan.version_read in equals:
        # The rollout runs on the last handoff's version; before iteration 1's, on the launch weights.
        if i == 1:
            del equals[plan.version_read]
        else:
            equals[plan.version_read] = str(i - 1)
        return {**step, "expect": {**step["expect"], "equals": equals}}
    return step


def _log(**fields: Any) -> None:
    sys.stdout.write(json.dumps({"ts": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()


class FrameworkTrainer:
    def __init__(
        self,
        url: str,
        seq: dict[str, Any],
        weights_dir: Path,
        step_timeout: float,
        real_payloads: bool = False,
        last_call: str | None = None,
    ) -> None:
        client = seq["client"]
        if client not in ITERATIONS:
            raise ValueError(f"no iteration defined for client {client!r} (known: {sorted(ITERATIONS)})")
        self.url = url
        self.plan = ITERATIONS[client]
        if last_call is not None:
            if last_call not in self.plan.handoff:
                raise ValueError(f"{last_call!r} is not a handoff step of {client}: {self.plan.handoff}")
            self.plan = replace(self.plan, last_call=last_call)
        self.steps: list[Step] = seq["steps"]
        run = select(self.steps, self.plan.rollout + self.plan.handoff)
        self.rollout, self.handoff = run[: len(self.plan.rollout)], run[len(self.plan.rollout) :]
        self.startup = select(self.steps, self.plan.startup) if self.plan.startup else []
        self.step_timeout = step_timeout
        self.weights_dir = weights_dir
        self.ctx = Context(weights_dir)
        if real_payloads:  # real SGLang opens the IPC handles: real CUDA tensors (needs torch and sglang)
            from rljob.testing.real_payloads import BUILDERS

            self.ctx.builders.update(BUILDERS)
        self.checkpoints: list[str] = []  # weights_dir placeholders: a checkpoint written per iteration
        for name, spec in seq.get("placeholders", {}).items():
            if spec["kind"] == "weights_dir":
                self.checkpoints.append(name)
            else:
                self.ctx.build(name, spec["kind"])

    def wait_for_server(self) -> None:
        if self.plan.launch_wait is None:
            self._wait_accepting()
            return
        self.send(_first(self.steps, self.plan.launch_wait), 0, "launch")

    def _wait_accepting(self) -> None:
        host, port = self.url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        deadline = time.monotonic() + self.step_timeout
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise StepFailed(f"no server accepts at {self.url}: {e}") from e
                time.sleep(0.5)

    def start(self) -> None:
        """The framework's start-up calls (AReaL: offload, then the first step's onload, no weights)."""
        for step in self.startup:
            self.send(step, 0, "startup")

    def iteration(self, i: int, last: bool = False) -> None:
        """Iteration `i`; the `last` one stops after the framework's last call (Iteration.last_call)."""
        for part, steps in (("rollout", self.rollout), ("handoff", self.handoff)):
            for step in steps:
                self.send(at_version(step, self.plan, i, part), i, part)
                if last and part == "handoff" and step["name"] == self.plan.last_call:
                    return

    def send(self, step: Step, i: int, part: str) -> None:
        self._write_checkpoints(step, i)
        time.sleep(step.get("sleep_s", 0))
        began = time.monotonic()
        answer, problems = run_step(self.url, step, self.ctx, self.step_timeout)
        _log(
            event="step",
            iteration=i,
            part=part,
            name=step["name"],
            wire=step.get("wire", "http"),
            status=answer.status,
            seconds=round(time.monotonic() - began, 3),
        )
        if problems:
            raise StepFailed(_failure(step, answer, problems))

    def _write_checkpoints(self, step: Step, i: int) -> None:
        pod = os.environ.get("RLJOB_POD_INDEX")
        for name in self.checkpoints:
            if "{{" + name + "}}" in (step.get("body") or ""):
                directory = self.weights_dir / (f"v{i}-pod{pod}" if pod else f"v{i}")
                self.ctx.values[name] = str(checkpoint_dir(directory, str(i)))


def _first(steps: list[Step], name: str) -> Step:
    return steps[_index_after(steps, name, 0)]


def _failure(step: Step, answer: Answer, problems: list[str]) -> str:
    reply = answer.error or f"{answer.status} {answer.content_type} {answer.text[:2000]!r}"
    return f"{step['name']} ({step['cite']}): {'; '.join(problems)}\nreply: {reply}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rljob.testing.framework_trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--replay", type=Path, required=True, help="a recorded sequence, tests/replays/<name>.json"
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=int(os.environ.get("RLJOB_ITERATIONS", "0")),
        help="stop after N iterations (default: env RLJOB_ITERATIONS; 0: forever)",
    )
    p.add_argument(
        "--real-payloads",
        action="store_true",
        help="tensor pushes carry real CUDA tensors: real SGLang behind the endpoint (a GPU, torch, sglang)",
    )
    p.add_argument(
        "--startup",
        action="store_true",
        help="send the framework's start-up calls first (AReaL's offload and onload, with no weights)",
    )
    p.add_argument(
        "--last-call",
        help="the handoff step of the last iteration to exit 0 after (default: the framework's last call)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take (a release answers once the gang's lease is granted)",
    )
    return p


def engine_url() -> str | None:
    """The agent's SGLang-compatible endpoint from RLJOB_ENGINE_URL; None, said on stderr, when unset."""
    url = os.environ.get("RLJOB_ENGINE_URL")
    if not url:
        print("RLJOB_ENGINE_URL is not set (the agent's SGLang-compatible endpoint)", file=sys.stderr)
    return url or None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    url = engine_url()
    if not url:
        return 1
    weights_dir = Path(os.environ.get("RLJOB_WEIGHTS_DIR", "/tmp/rljob-weights"))
    trainer = FrameworkTrainer(
        url, load(args.replay), weights_dir, args.step_timeout, args.real_payloads, args.last_call
    )
    try:
        trainer.wait_for_server()
        if args.startup:
            trainer.start()
        i = 0
        while args.iterations == 0 or i < args.iterations:
            i += 1
            trainer.iteration(i, last=i == args.iterations)
    except StepFailed as e:
        print(f"STEP FAILED: {e}", file=sys.stderr, flush=True)
        return 2
    _log(event="done", iterations=i)
    return 0


if __name__ == "__main__":
    sys.exit(main())
