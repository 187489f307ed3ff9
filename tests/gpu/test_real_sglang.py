"""Real SGLang 0.5.15.post1 on the GPU on the tiny model (rljob.testing.tiny_model): the protocol, driven
by the real agent (`--gpu-probe nvml`), with a real torch trainer (real_trainer.py) in the memory SGLang
releases. The same iterations at Llama-3-8B's size, for the figures: test_real_sglang_8b.py.

test_agent_drives_real_sglang: 3 iterations (refit from disk, by tensor through the SDK's CUDA-IPC
packing, from disk), real_iterations.drive: each with 3 requests in flight, drain (abort), release of
every tag verified by NVML, the trainer allocating most of the freed memory, refit, the trainer's memory
back, resume; then SGLang's logprobs for fixed prompts equal a transformers forward of the same weights in
the trainer (LOGPROB_TOLERANCE) and SGLang's own disk load of the same version (SAME_WEIGHTS_TOLERANCE), a
prompt served before the refit is not answered from its old cache, and SGLang never restarted. Between
agent iterations the test makes the same SGLang calls itself (no agent; a tensor refit pushed straight to
SGLang by direct_push.py), so each phase's agent command compares with SGLang's own calls in the same run.
Figures: $RLJOB_GPU_RESULTS_DIR/real_sglang.{json,md}.

test_differential (and, last, test_differential_without_memory_saver): every sequence of
tests/differential/sequences.json and tests/replays to real SGLang and to the emulator at the same
version, each server launched as the sequence's client launches SGLang (with or without the memory saver:
differential.without_memory_saver), each sequence from a stated server state (differential.RESET); the real
answers are written to $RLJOB_GPU_RESULTS_DIR/real-0.5.15.post1.json (committed as
tests/differential/real-0.5.15.post1.json, which tests/agent/test_differential.py holds the emulator to in
CI) with the differences table."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, PY, Agent, AgentDriver, Emulator, Proc
from gpu_helpers import markdown_table, while_alive
from real_iterations import (  # noqa: F401  (LOGPROB_TOLERANCE, generate: for the other real-SGLang tests)
    IN_FLIGHT,
    LOGPROB_TOLERANCE,
    InFlight,
    Served,
    drive,
    generate,
    summarize,
    timed,
    tokens,
    wait_running,
)
from real_sglang import LAUNCH_FLAGS, VERSION, RealSGLang, sglang_missing

from rljob.testing import differential, real_payloads
from rljob.testing.tiny_model import TinyLlama

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DIFFERENTIAL = ROOT / "tests" / "differential"
EMULATOR_TPS = 1000  # the emulator's tokens per second per request: long requests are in flight for seconds
PLAN = ("disk", "tensor", "disk")


class Launched:
    """The module's real SGLang and the model it serves; launched again before a test when the last one
    failed (it may have left the server paused, with tags released) or the server is gone. A test that
    passed leaves it serving, every tag resident."""

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

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    reason = sglang_missing()
    if reason:
        pytest.skip(f"real-SGLang tier: {reason}")
    holder = Launched(tmp_path_factory.mktemp("real"))
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def real(launched: Launched, request: pytest.FixtureRequest) -> Iterator[tuple[RealSGLang, Path, TinyLlama]]:
    yield launched.ready(), launched.tmp, launched.model
    report = getattr(request.node, "rep_call", None)
    launched.dirty = report is None or not report.passed


def test_agent_drives_real_sglang(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    server, tmp, _ = real
    procs: list[Proc] = []
    seen: dict[str, Any] = {}
    served = Served("tiny", tmp / "v0", reference=True)
    try:
        drive(server, tmp, served, PLAN, procs, seen)
    except BaseException:
        # What the iterations that ran saw, and every process's log, for a run that did not finish.
        (results_dir / "real_sglang_partial.json").write_text(json.dumps(seen, indent=1, default=str))
        for p in procs:
            (results_dir / f"partial_{p.name}.log").write_text(p.log_text()[-400_000:])
        raise
    finally:
        for p in reversed(procs):
            p.stop()
    report = summarize(server, seen)
    (results_dir / "real_sglang.json").write_text(json.dumps(report, indent=1, default=str))
    (results_dir / "real_sglang.md").write_text(report["markdown"])
    agent = next(p for p in procs if p.name == "agent")
    (results_dir / "real_sglang_agent.log").write_text(agent.log_text()[-400_000:])
    print("\n" + report["markdown"])


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


NO_SAVER = "no-memory-saver"  # the recording's name of the launch without --enable-memory-saver


def _differential(
    server: RealSGLang,
    tmp: Path,
    results_dir: Path,
    sequences: list[dict[str, Any]],
    left_out: dict[str, str],
    launch_name: str | None = None,
) -> list[dict[str, Any]]:
    """`sequences` to the emulator and to real SGLang (`server`, launched with the flags of `launch_name`:
    the tier's LAUNCH_FLAGS when None), each from the RESET state; the real answers are added to
    $RLJOB_GPU_RESULTS_DIR/real-<version>.json (under `launches` for another launch) and the table of
    every sequence so far to differential.md."""
    launch = tmp / "v0"
    tag = f"{launch_name or 'saver'}-{len(sequences)}-{int(time.monotonic() * 1e3)}"
    emu = Emulator(
        tmp, VERSION, *server.flags, "--model-path", str(launch), memory_saver=False, tps=EMULATOR_TPS
    )
    try:
        emu.wait_ready(60)
        emu_obs = differential.run_all(
            emu.url,
            emu.alive,
            sequences,
            VERSION,
            differential.contexts(tmp / f"emu-{tag}", launch),
            reset=True,
        )
    finally:
        emu.stop()
    real_ctx = differential.contexts(tmp / f"real-{tag}", launch, real_payloads.BUILDERS)
    real_obs = differential.run_all(server.url, server.alive, sequences, VERSION, real_ctx, reset=True)
    record_file = results_dir / f"real-{VERSION}.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {
        "version": VERSION, "launch_flags": list(LAUNCH_FLAGS), "emulator_tps": EMULATOR_TPS,
        "left_out": {}, "reset": differential.RESET_STATE, "sequences": [], "launches": {},
    }  # fmt: skip
    emu_file = results_dir / f"emulator-{VERSION}.json"
    emulated = json.loads(emu_file.read_text())["sequences"] if emu_file.exists() else []
    if launch_name is None:
        record["left_out"] = left_out
        record["sequences"] += real_obs
    else:
        other = record["launches"].setdefault(
            launch_name, {"launch_flags": list(server.flags), "sequences": []}
        )
        other["sequences"] += real_obs
    record_file.write_text(json.dumps(record, indent=1))
    emu_file.write_text(json.dumps({"sequences": emulated + emu_obs}, indent=1))
    every_real = record["sequences"] + [o for v in record["launches"].values() for o in v["sequences"]]
    text = differential.table(
        every_real, emulated + emu_obs, differential.recorded(DIFFERENTIAL / "known-differences.json")
    )
    sent = {o["name"] for o in every_real}
    text += "".join(
        f"- {name}: not sent, {why}\n" for name, why in record["left_out"].items() if name not in sent
    )
    (results_dir / "differential.md").write_text(text)
    print("\n" + text)
    assert [o["name"] for o in real_obs] == [s["name"] for s in sequences], "a sequence was not sent"
    return real_obs


def _saver_sequences(fatal: bool) -> tuple[list[dict[str, Any]], dict[str, str]]:
    sequences, left_out = differential.load_sequences(
        DIFFERENTIAL / "sequences.json", ROOT / "tests" / "replays", LAUNCH_FLAGS
    )
    return [s for s in sequences if bool(s.get("fatal")) == fatal], left_out


def test_differential(real: tuple[RealSGLang, Path, TinyLlama], results_dir: Path) -> None:
    """Every sequence SGLang survives, to both servers (the table: differential.md)."""
    server, tmp, _ = real
    _differential(server, tmp, results_dir, *_saver_sequences(fatal=False))
    assert server.alive()


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
    it["version"] = agent.state()["engine"]["servedVersion"]
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
    """After the tests that need the module's server: the fatal sequence (a release with a request in
    flight) ends real SGLang, and the emulator with it."""
    server, tmp, _ = real
    obs = _differential(server, tmp, results_dir, *_saver_sequences(fatal=True))
    assert obs and not obs[-1]["alive_after"] and not server.alive()


def test_differential_without_memory_saver(launched: Launched, results_dir: Path) -> None:
    """Last in this module: the replays whose client launches SGLang without --enable-memory-saver
    (AReaL's SGLangConfig, areal/api/cli_args.py: enable_memory_saver False; SGLang's own test of
    update_weights_from_disk) to a server launched so, and to the emulator launched the same way (a
    release then frees nothing). The module's server is stopped first: two servers do not fit the card."""
    launched.stop()
    flags = differential.without_memory_saver(LAUNCH_FLAGS)
    sequences, _ = differential.load_sequences(
        DIFFERENTIAL / "sequences.json", ROOT / "tests" / "replays", flags, own_sequences=False
    )
    assert {s["name"] for s in sequences} >= {"replay:areal"}, [s["name"] for s in sequences]
    server = RealSGLang(launched.tmp, launched.launch, *flags)
    try:
        server.wait_ready()
        _differential(server, launched.tmp, results_dir, sequences, {}, launch_name=NO_SAVER)
        assert server.alive()
    finally:
        server.stop()
