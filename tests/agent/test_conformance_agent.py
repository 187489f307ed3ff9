"""The agent against the rows of docs/sglang-conformance.md that it must get right, with the real agent
process against the real emulator process, on every emulated SGLang version each row applies to. The row
IDs are in each test's docstring. A correct agent never kills SGLang (the `procs` fixture fails a test
whose emulator died, unless the test expects it)."""

from __future__ import annotations

import threading
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import (
    ALL_TAGS,
    RETRACT_REFUSED,
    Agent,
    AgentDriver,
    Emulator,
    free_port,
    http,
    wait_until,
    write_weights,
)

from rljob.agent.actions import check_leader as check
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.errors import Refused
from rljob.api.agent import AgentState, DrainCommand, RefitCommand, ResumeCommand, Stage
from rljob.api.spec import DrainMode, RefitSource
from rljob.emulator.rendezvous import Rank0
from rljob.emulator.versions import SUPPORTED_VERSIONS
from rljob.trainer import Handoff, LeaseError

PROBE_TIMEOUT_S = 1.0  # the agent's --scheduler-probe-timeout in these tests (default 5)
HEALTH_ROUTES = ("/health", "/health_generate")


class Traffic:
    """Rollout clients generating in a loop until stopped; what they got back."""

    def __init__(self, emu: Emulator, clients: int = 3, max_new_tokens: int = 40, **extra: Any) -> None:
        self.emu, self.replies, self.errors = emu, [], []
        self.replies: list[dict[str, Any]]
        self.errors: list[str]
        self._stop = threading.Event()
        body = {"sampling_params": {"max_new_tokens": max_new_tokens}, **extra}
        self._threads = [
            threading.Thread(target=self._client, args=({**body, "text": f"prefix {i}"},), daemon=True)
            for i in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _client(self, body: dict[str, Any]) -> None:
        while not self._stop.is_set():
            r = self.emu.call("POST", "/generate", body, timeout=60)
            if r.status != 200:
                self.errors.append(r.text)
                return
            self.replies.append(r.body)

    def halt(self) -> None:
        """No new requests; one held by a pause stays held until SGLang continues."""
        self._stop.set()

    def stop(self) -> None:
        self.halt()
        for t in self._threads:
            t.join(60)
        assert not self.errors, self.errors


def _calls(emu: Emulator, *routes: str) -> int:
    calls = emu.stats()["calls"]
    return sum(int(calls.get(r, 0)) for r in routes)


def _in_flight(emu: Emulator) -> None:
    wait_until(lambda: emu.stats()["running"] > 0, 10, "rollout requests in flight")


def _refit_async(agent: Agent, c: AgentDriver, **fields: Any) -> None:
    c.epoch += 1
    r = agent.command("refit", c.epoch, wait=0, **fields)
    assert r.status == 202, r.text


def _outcome(agent: Agent, timeout: float = 20) -> dict[str, Any]:
    st = agent.wait_state(lambda s: s["lastCommand"]["state"] != "Running", timeout, "the command to finish")
    return dict(st["lastCommand"])


# --- drains (C-DRAIN-ABORT, C-DRAIN-RETRACT, C-IDLE-FLUSH, C-IDLE-FLUSH-DEFERRED, C-IDLE-RELEASE) ----


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_abort_and_retract_drains_with_requests_in_flight(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-DRAIN-ABORT, C-DRAIN-RETRACT, C-IDLE-FLUSH(-DEFERRED), C-IDLE-RELEASE, C-REFIT-FLUSH-RETRACT,
    C-HEALTH-GENERATE, C-REFIT-WV-PAUSED. Two iterations with rollout requests in flight at each drain: an
    abort drain, then a retract drain. Retract is refused where retracted (waiting) requests always count
    (0.5.15.post1, 0.5.20): there the iteration drains with abort. Elsewhere the retracted requests wait
    through release, refit and resume, and the agent's idle barrier uses the plain flush: the deferred
    `?timeout=` one would never pass (drain timeout 5 s). /health* is never called while paused."""
    emu = start_emulator(version, tps=100)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    traffic = Traffic(emu)
    for v, mode in (("1", "abort"), ("2", "retract")):
        _in_flight(emu)
        if mode == "retract" and version in RETRACT_REFUSED:
            r = c.refused("drain", "RetractUnsupported", mode=mode, _emulator_url=emu.url)
            assert "waiting" in r["reason"] and "abort" in r["reason"] and r["permanent"] is True, r
            mode = "abort"  # what the operator falls back to
        health = _calls(emu, *HEALTH_ROUTES)
        c.ok("drain", mode=mode, timeoutSeconds=5)
        if mode == "retract":
            assert emu.stats()["waiting"] > 0, "nothing was retracted: no request was in flight"
        c.ok("release", tags=ALL_TAGS)
        assert emu.stats()["offload_tags"] == sorted(ALL_TAGS)
        c.ok("grant")
        c.publish(v, str(write_weights(tmp_path, v)))
        c.ok("refit", version=v)
        assert _calls(emu, *HEALTH_ROUTES) == health, "a health probe reached SGLang while paused"
        c.ok("resume")
        assert agent.state()["engine"]["servedVersion"] == v
    traffic.stop()
    finished = [r for r in traffic.replies if r["meta_info"]["finish_reason"]["type"] == "length"]
    assert "2" in {r["meta_info"]["weight_version"] for r in finished}
    assert not any("GARBAGE" in r["text"] for r in traffic.replies)
    # 0.5.6 ignores weight_version on a paused refit: one /update_weight_version per refit, nowhere else
    assert _calls(emu, "/update_weight_version") == (2 if version == "0.5.6" else 0)


def test_drain_refusals_by_version() -> None:
    """C-DRAIN-RETRACT / C-IDLE-RELEASE boundaries as the guards apply them, and C-DP-FANOUT's refusal
    under DP attention (pure functions: nothing reaches SGLang)."""
    serving = AgentState(revision=1, boot_id="b", stage=Stage.SERVING)

    def facts(version: str, **kw: Any) -> SGLangFacts:
        return SGLangFacts(version, "off", True, False, kw.pop("dp_size", 1), **kw)

    retract = DrainCommand(epoch=1, mode=DrainMode.RETRACT)
    for version in ("0.5.6", "0.5.8", "0.5.21", "0.5.23"):
        check(retract, serving, facts(version))
    for version in ("0.5.9", "0.5.10", "0.5.15.post1", "0.5.20"):
        with pytest.raises(Refused) as err:
            check(retract, serving, facts(version))
        assert (err.value.error, err.value.permanent) == ("RetractUnsupported", True)
        assert "spec.rollout.drain.mode: abort" in err.value.reason
    # C-DP-LOADS-PAUSED: at dp > 1 no rank can be proven idle after a retract where the load route reads
    # snapshots a paused scheduler never republishes; 0.5.8 still asks the schedulers
    check(retract, serving, facts("0.5.8", dp_size=2))
    for version in ("0.5.21", "0.5.23"):
        with pytest.raises(Refused) as err:
            check(retract, serving, facts(version, dp_size=2))
        assert (err.value.error, err.value.permanent) == ("RetractUnsupported", True)
        assert "C-DP-LOADS-PAUSED" in err.value.reason
        check(DrainCommand(epoch=1), serving, facts(version, dp_size=2))
    check(DrainCommand(epoch=1), serving, facts("0.5.20"))
    for cmd in (DrainCommand(epoch=1), ResumeCommand(epoch=1), RefitCommand(epoch=1, version="1", path="/w")):
        with pytest.raises(Refused) as err:
            check(cmd, serving, facts("0.5.21", dp_size=2, dp_attention=True))
        assert (err.value.error, err.value.permanent) == ("DataParallelAttentionUnsupported", True)
    tensor = RefitCommand(epoch=1, version="1", source=RefitSource.TENSOR)
    with pytest.raises(Refused) as err:
        check(tensor, serving, facts("0.5.23", dp_size=2))
    assert (err.value.error, err.value.permanent) == ("DataParallelUnsupported", True)
    with pytest.raises(Refused) as err:  # the moment explains it: the same drain is taken later
        check(
            DrainCommand(epoch=1), AgentState(revision=1, boot_id="b", stage=Stage.RELEASED), facts("0.5.23")
        )
    assert (err.value.error, err.value.permanent) == ("IllegalTransition", False)
    q = {v: SGLangQuirks.detect(v) for v in ("0.5.6", "0.5.6.post2", "0.5.8", "0.5.10", "0.5.23")}
    assert [q[v].refit_while_paused_records_version for v in q] == [False, True, True, True, True]
    assert [q[v].flush_takes_timeout for v in q] == [False, False, False, True, True]
    assert [q[v].subprocess_watchdog for v in q] == [False, False, False, True, True]
    assert [q[v].load_route for v in q] == ["/get_load", "/get_load", "/v1/loads", "/v1/loads", "/v1/loads"]


# --- data parallel (C-DP-FANOUT, C-DP-FLUSH-FIRST, C-DP-RELEASE-ALL, C-REFIT-DP) --------------------


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_dp2_release_proves_every_rank_idle(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-DP-FLUSH-FIRST, C-DP-RELEASE-ALL, C-METRIC-LOAD-ROUTE, C-REFIT-DP. With --dp-size 2 one flush 200 is
    the first rank's answer while release asserts on both. A request left running on DP rank 1 (paused in
    place behind the agent's back) passes a flush but not the agent's per-rank proof (`/get_load` on 0.5.6,
    `/v1/loads` after): the release fails with the busy rank named and never reaches SGLang. Once rank 1
    is idle the iteration completes, with a disk refit fanned out to both ranks; a tensor refit is
    refused."""
    emu = start_emulator(version, "--dp-size", "2", tps=100)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    traffic = Traffic(emu, clients=2)  # round robin: both ranks serve
    wait_until(lambda: all(r["running"] > 0 for r in emu.stats()["ranks"]), 10, "both ranks busy")
    c.ok("drain")
    traffic.halt()
    # The hazard: rank 1 still has a running request, which one flush does not show.
    assert emu.call("POST", "/continue_generation", {}).status == 200
    traffic.stop()  # the requests the drain held finish first
    body = {"text": "long", "sampling_params": {"max_new_tokens": 2000}, "data_parallel_rank": 1}
    job = threading.Thread(target=lambda: emu.call("POST", "/generate", body, timeout=60), daemon=True)
    job.start()
    wait_until(lambda: emu.stats()["ranks"][1]["running"] == 1, 10, "a request on rank 1")
    assert emu.call("POST", "/pause_generation", {"mode": "in_place"}).status == 200
    wait_until(lambda: all(r["scheduler_paused"] for r in emu.stats()["ranks"]), 5, "the in-place pause")
    # rank 0's answer hides rank 1 (once rank 0 has reaped what the traffic left)
    wait_until(lambda: emu.call("POST", "/flush_cache").status == 200, 5, "a flush 200 from rank 0")
    assert emu.stats()["ranks"][1]["running"] == 1
    failed = c.failed("release", tags=ALL_TAGS, verify={"timeoutSeconds": 1})
    assert "DP rank 1: 1 running" in failed["error"], failed
    assert _calls(emu, "/release_memory_occupation") == 0 and emu.alive()
    assert agent.state()["stage"] == "Drained"
    assert emu.call("POST", "/abort_request", {"abort_all": True}).status == 200
    job.join(30)
    wait_until(lambda: emu.stats()["idle"], 10, "rank 1 to become idle")
    # the in-place pause froze rank 1's load snapshot (C-DP-LOADS-PAUSED): undo it, back to an abort drain
    assert emu.call("POST", "/continue_generation", {}).status == 200
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    c.ok("release", tags=ALL_TAGS)
    assert _calls(emu, "/release_memory_occupation") == 1
    c.ok("grant")
    c.publish("1", str(write_weights(tmp_path, "1")))
    c.ok("refit", version="1")
    c.ok("resume")
    assert agent.state()["engine"]["servedVersion"] == "1"
    c.refused("refit", "DataParallelUnsupported", version="2", source="tensor", _emulator_url=emu.url)


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_dp2_retract_is_refused_for_good(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-DP-LOADS-PAUSED: with --dp-size 2 a retracted rank keeps publishing its pre-pause counts, so no
    rank can be proven idle and the drain would wait for its deadline with SGLang paused. The agent refuses
    the retract up front, permanently, naming what to change; nothing reaches SGLang, which keeps serving.
    An abort drain then runs the iteration."""
    emu = start_emulator(version, "--dp-size", "2", tps=100)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    traffic = Traffic(emu, clients=2)
    wait_until(lambda: all(r["running"] > 0 for r in emu.stats()["ranks"]), 10, "both ranks busy")
    r = c.refused("drain", "RetractUnsupported", mode="retract", timeoutSeconds=3, _emulator_url=emu.url)
    assert r["permanent"] is True and "spec.rollout.drain.mode: abort" in r["reason"], r
    assert not emu.stats()["ranks"][0]["scheduler_paused"] and agent.state()["stage"] == "Serving"
    served = len(traffic.replies)
    wait_until(lambda: len(traffic.replies) > served, 10, "rollout to go on after the refusal")
    c.ok("drain", mode="abort", timeoutSeconds=5)
    traffic.halt()
    c.ok("release", tags=ALL_TAGS)
    c.ok("grant")
    c.publish("1", str(write_weights(tmp_path, "1")))
    c.ok("refit", version="1")
    c.ok("resume")
    traffic.stop()  # the requests the pause held finish on the new weights
    assert agent.state()["engine"]["servedVersion"] == "1"


# --- distributed refit with a peer that joins (C-REFIT-GROUP-BLOCK) ---------------------------------


@pytest.mark.parametrize("version", ["0.5.6", "0.5.15.post1", "0.5.23"])
def test_distributed_refit_where_the_trainer_joins_the_group(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-GROUP-BLOCK, C-ROUTE-SESSION, C-REFIT-WV-PAUSED, C-DEATH-HARD. SGLang's group init returns
    only once the trainer (group rank 0) has joined. The SDK's init_group returns at once, so the trainer
    runs its own rank-0 rendezvous meanwhile and then waits for the group. While SGLang waits, the agent
    reports the group Pending, refuses pushes Busy and does not probe the blocked scheduler: on 0.5.6 the
    wait outlasts two probe timeouts without the agent declaring SGLang dead."""
    emu = start_emulator(version, "--weight-update-group-timeout", "30")
    agent = start_agent(emu, "--scheduler-probe-timeout", str(PROBE_TIMEOUT_S))
    c = AgentDriver(agent)
    c.iteration_to_trained("1", None)
    _refit_async(agent, c, version="1", source="distributed")
    handoff = Handoff(agent.trainer_url)
    with handoff.refit_window(timeout=10) as w, Rank0(0, world_size=2) as rank0:
        started = time.monotonic()
        w.init_group("127.0.0.1", rank0.port, rank_offset=1, world_size=2)
        assert time.monotonic() - started < 2, "init_group waited for SGLang's rendezvous"
        assert agent.state()["trainer"]["weightsGroup"] == "Pending"
        meta = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 2]]}
        r = agent.trainer("POST", "/v1/trainer/refit/distributed", meta)
        assert r.status == 409 and r.body["error"] == "Busy", r.text
        if version == "0.5.6":  # longer than two probe rounds (timeout + 1 s interval each)
            time.sleep(2 * (PROBE_TIMEOUT_S + 1) + 0.5)
            assert agent.state()["stage"] != "Failed", agent.state()["fatal"]
        assert rank0.wait(10) == [1]  # the trainer's own init_process_group(rank=0) returns
        w.wait_group(timeout=10)
        w.push_distributed(["w"], ["float32"], [[2, 2]])
    out = _outcome(agent)
    assert out["state"] == "Succeeded", out
    st = agent.state()
    assert st["stage"] == "Refitted" and st["engine"]["servedVersion"] == "1"
    assert st["trainer"]["weightsGroup"] == "Ready"
    calls = emu.stats()["calls"]
    assert calls.get("/begin_weight_update", 0) == int(version in ("0.5.21", "0.5.23"))
    assert calls.get("/update_weight_version", 0) == int(version == "0.5.6")
    c.ok("resume")


def test_group_that_nobody_joins_fails_and_frees_the_agent(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-GROUP-BLOCK: the trainer never hosts the group. SGLang's rendezvous times out (400 "Failed to
    initialize custom process group"); the agent reports the group Failed with SGLang's reason, the
    trainer's wait raises, the refit fails, and the agent takes commands again."""
    emu = start_emulator("0.5.23", "--weight-update-group-timeout", "1")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.iteration_to_trained("1", str(write_weights(tmp_path, "1")))
    _refit_async(agent, c, version="1", source="distributed")
    handoff = Handoff(agent.trainer_url)
    failure = pytest.raises(LeaseError, match="Failed to initialize custom process group")
    with failure, handoff.refit_window(timeout=10) as w:
        w.init_group("127.0.0.1", free_port(), rank_offset=1, world_size=2)  # nobody listens there
        w.wait_group(timeout=10)
    out = _outcome(agent)
    assert out["state"] == "Failed", out
    assert agent.state()["trainer"]["weightsGroup"] == "Failed"
    c.ok("refit", version="1")  # not Busy any more: a disk refit of the published checkpoint


# --- 0.5.6: a refit while paused ignores weight_version (C-REFIT-WV-PAUSED) -------------------------


def test_paused_refit_on_0_5_6_serves_the_new_version(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-WV-PAUSED, C-ROUTE-WV-SET, C-ROUTE-WV-READ: 0.5.6 returns from a refit while paused before it
    records weight_version; the agent sets it with /update_weight_version (abort_all_requests false) and
    reads it back from /model_info. Generation after the resume carries the new version."""
    emu = start_emulator("0.5.6")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.iteration_to_trained("7", str(write_weights(tmp_path, "7")))
    c.ok("refit", version="7")
    assert _calls(emu, "/update_weight_version") == 1
    assert emu.call("GET", "/model_info").body["weight_version"] == "7"
    assert emu.weights()["weight_version"] == "7"
    c.ok("resume")
    r = emu.call("POST", "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}})
    assert r.body["meta_info"]["weight_version"] == "7"


# --- death when /ping lies (C-DEATH-HARD) -----------------------------------------------------------


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_scheduler_death_is_detected_within_its_deadline(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-DEATH-HARD, C-HEALTH-PING, C-HEALTH-RELEASED. The scheduler process dies while SGLang is paused
    and released. 0.5.6 has no watchdog: HTTP stays up and /ping says 200, but the agent's bounded
    /get_load probe goes unanswered twice and it fails with "scheduler dead" within 2 x (probe timeout +
    1 s interval) plus slack. 0.5.23's watchdog kills the server: a refused connection. No /health* call
    reaches SGLang meanwhile."""
    emu = start_emulator(version)
    agent = start_agent(emu, "--scheduler-probe-timeout", str(PROBE_TIMEOUT_S))
    c = AgentDriver(agent)
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    time.sleep(2 * (PROBE_TIMEOUT_S + 1))  # probes answered while paused and released: no false alarm
    assert agent.state()["stage"] == "Released"
    health = _calls(emu, *HEALTH_ROUTES)
    started = time.monotonic()
    try:
        emu.call("POST", "/_emulator/kill_scheduler", timeout=5)
    except (ConnectionError, urllib.error.URLError, OSError):
        assert version != "0.5.6"  # the dying server drops the call
    st = agent.wait_stage("Failed", timeout=15)
    elapsed = time.monotonic() - started
    if version == "0.5.6":
        assert "scheduler dead" in st["fatal"], st["fatal"]
        assert elapsed < 2 * (PROBE_TIMEOUT_S + 1) + 2, elapsed
        assert emu.alive() and http("GET", emu.url + "/ping").status == 200  # the zombie /ping lies
        assert _calls(emu, *HEALTH_ROUTES) == health
    else:
        assert "stopped answering" in st["fatal"], st["fatal"]
        assert elapsed < 5, elapsed
        assert emu.wait_exit(5) != 0
