"""The real agent driving the vLLM emulator (agent/engines/vllm/), at every recorded vLLM version: the whole
handoff with disk and tensor refits, what the agent reports of it, and each guard against what kills vLLM
or makes it serve garbage. Where a guard refuses, the same call sent to the emulator directly shows what it
would have done (the emulator dies, or serves garbage or stale KV). Rows: docs/vllm-conformance.md."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Agent, AgentDriver, http, wait_until
from vllm_procs import GARBAGE, VLLM_VERSIONS, VllmEmulator, start_long_request, write_model

from rljob.testing.ipc_stand_in import vllm_update
from rljob.testing.trainer import make_tensors
from rljob.trainer.engines.vllm import digest as vllm_digest

NEW = "0.34.0"
TAGS = ["kv_cache", "weights"]
IPC = ("--weight-transfer-config", '{"backend": "ipc"}')
INSECURE = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
SIM_LAYOUT = vllm_digest.ModelLayout("LlamaForCausalLM")
StartVllm = Callable[..., VllmEmulator]
StartAgent = Callable[..., Agent]


@pytest.fixture(params=VLLM_VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def vllm_pod(
    start_vllm: StartVllm,
    start_agent: StartAgent,
    version: str,
    *flags: str,
    agent_args: tuple[str, ...] = (),
    serving: bool = True,
    **kw: Any,
) -> tuple[VllmEmulator, Agent, AgentDriver]:
    emu = start_vllm(version, *flags, **kw)
    agent = start_agent(emu, "--engine", "vllm", *agent_args, serving=serving)
    return emu, agent, AgentDriver(agent)


def hits(emu: VllmEmulator) -> float:
    return emu.metric("vllm:prefix_cache_hits_total")


def text(emu: VllmEmulator, prompt: str) -> str:
    r = emu.complete(prompt, max_tokens=4)
    assert r.status == 200, r.text
    return str(r.body["choices"][0]["text"])


def served_label(emu: VllmEmulator) -> str | None:
    """What vLLM says it serves: 0.34's /weight_info; 0.26 carries no label."""
    if emu.version != NEW:
        return None
    return str(emu.ok("GET", "/weight_info").body["weight_version"])


def check_weights(st: dict[str, Any], emu: VllmEmulator, version: str, *, digest: bool) -> None:
    w = st["engine"]["weights"]
    if emu.version == NEW:  # V-ROUTE-CHECKER: held against the weights before and the trainer's digest
        assert w["version"] == version and w.get("mismatch") is None, w
        assert "Previous" in w["checked"], w
        assert ("Trainer" in w["checked"]) == digest, w
        assert st["engine"]["servedVersionSource"] == "Engine"
        assert served_label(emu) == version
    else:  # 0.26: no route reads weights back, and the label is the agent's; both said, never silent
        assert w["unverified"].startswith("weights not verified: vLLM 0.26.0 has no route"), w
        assert w["checked"] == [] and w.get("checksum") is None, w
        assert st["engine"]["servedVersionSource"] == "Agent"


# --- the whole cycle ------------------------------------------------------------------------------------


def test_three_iterations_with_disk_refits(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """Drain, release (a level-2 sleep, verified on the GPUs), grant, publish, refit (weights woken, the
    checkpoint reloaded, the prefix cache reset, the label and the content checked, all before the KV cache
    wakes: nothing forwarded meanwhile), resume (the kv_cache wake, then a generated token), three times."""
    emu, agent, c = vllm_pod(start_vllm, start_agent, version)
    prompt = " ".join(f"w{i}" for i in range(40))  # two whole KV blocks of 16 tokens: cacheable
    for i in (1, 2, 3):
        v = str(i)
        before = text(emu, prompt)
        assert text(emu, prompt) == before and hits(emu) > 0  # the prefix is cached now
        c.ok("drain")
        assert emu.engine()["pause_state"] != "unpaused"
        c.ok("release", tags=TAGS)
        st = agent.state()
        assert st["memory"]["verified"] and st["memory"]["freedBytes"] > 0, st["memory"]
        assert sorted(emu.engine()["unmapped_tags"]) == TAGS
        c.ok("grant")
        path = write_model(tmp_path / f"v{v}", str(i + 1))  # other weights than the launch's
        r = agent.trainer(
            "POST",
            "/v1/trainer/publish",
            {"version": v, "path": str(path), "digest": vllm_digest.checkpoint_digest(path).wire()},
        )
        assert r.status == 200, r.text
        c.ok("refit", version=v)
        st = agent.state()
        assert st["stage"] == "Refitted" and st["engine"]["servedVersion"] == v
        assert st["releasedTags"] == ["kv_cache"] and st["engine"].get("unloaded") is None
        eng = emu.engine()
        assert eng["unmapped_tags"] == ["kv_cache"] and eng["pause_state"] != "unpaused"
        check_weights(st, emu, v, digest=True)
        hits_before = hits(emu)
        c.ok("resume")
        st = agent.state()
        assert st["stage"] == "Serving" and st["releasedTags"] == [] and not st["engine"]["paused"]
        after = text(emu, prompt)
        assert GARBAGE not in after and after != before  # the new weights, not garbage
        assert hits(emu) == hits_before  # V-ROUTE-FLUSH: nothing of the old weights' KV was hit
    assert json.loads(http("GET", emu.url + "/_emulator/calls").text)["repeats"] == []


def test_a_refit_without_a_release_resets_the_prefix_cache(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """V-REFIT-DISK: vLLM's reload does not reset the prefix cache (sent directly below with a pause that
    keeps it: the hit count grows on the new weights). With no sleep before the reload (a rejoin) the
    agent's drain pauses with clear_cache and the agent resets the cache again after the reload."""
    emu, _agent, c = vllm_pod(start_vllm, start_agent, version)
    prompt = " ".join(f"w{i}" for i in range(40))
    text(emu, prompt)
    c.ok("refit", version="1", path=str(write_model(tmp_path / "v1", "3")))  # from Serving: drains first
    c.ok("resume")
    before = hits(emu)
    text(emu, prompt)
    assert hits(emu) == before, "the refitted engine hit KV computed by the old weights"
    emu.ok("POST", "/pause?mode=abort&clear_cache=false")  # the prompt is cached on the weights 1
    r = emu.call(
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "v1")}},
    )
    assert r.status == 200, r.text
    emu.ok("POST", "/resume")
    before = hits(emu)
    text(emu, prompt)
    assert hits(emu) > before  # reloaded, and served from the old KV


def test_three_iterations_with_tensor_refits(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """Tensor refits through vLLM's native IPC weight transfer: the agent inits it once, and per refit
    starts a session, forwards the trainer's packed updates (stand-in IPC handles whose bytes the emulator
    reads), finishes it; on 0.34 the weights vLLM then holds are the trainer's, parameter by parameter."""
    shared = tmp_path / "ipc"
    emu, agent, c = vllm_pod(
        start_vllm, start_agent, version, *IPC, "--ipc-stand-in-dir", str(shared), env=INSECURE,
        agent_args=("--refit-source", "tensor"),
    )  # fmt: skip
    assert agent.state()["engine"].get("launchRefusal") is None
    for i in (1, 2, 3):
        v = str(i)
        c.iteration_to_trained(v, None, TAGS)
        c.epoch += 1
        assert agent.command("refit", c.epoch, wait=0, version=v, source="tensor").status == 202
        window = agent.trainer("GET", "/v1/trainer/refit?wait=10").body
        assert window["open"] and window["engine"] == "vllm", window
        tensors = make_tensors(str(10 + i), 16 << 10)
        names = sorted(tensors)
        for n, name in enumerate(names):
            push = {"updateInfo": vllm_update({name: tensors[name]}, shared), "last": n == len(names) - 1}
            r = agent.trainer("POST", "/v1/trainer/refit/tensor", push)
            assert r.status == 200, r.text
        digest = vllm_digest.digest_named_tensors([(n, tensors[n]) for n in names], SIM_LAYOUT)
        assert agent.trainer("POST", "/v1/trainer/refit/close", {"digest": digest.wire()}).status == 200
        st = agent.wait_state(lambda s: s["lastCommand"]["epoch"] == c.epoch and s["stage"] != "Trained", 15)
        assert st["stage"] == "Refitted", st["lastCommand"]
        check_weights(st, emu, v, digest=True)
        c.ok("resume")
        assert GARBAGE not in text(emu, "a b c")
    calls = emu.stats()["calls"]
    assert calls["/init_weight_transfer_engine"] == 1  # once per vLLM process
    assert calls["/start_weight_update"] == calls["/finish_weight_update"] == 3


def test_a_wait_drain_lets_running_requests_finish(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """V-DRAIN-WAIT: the drain answers once the running request finished (not aborted); a retract is
    `keep` with the cache cleared (V-DRAIN-KEEP): the request is preempted, then finishes after the
    resume."""
    emu, _agent, c = vllm_pod(start_vllm, start_agent, version, tps=200)
    running = start_long_request(emu, max_tokens=60)
    c.ok("drain", mode="wait")
    assert running.done(), "the wait drain answered while its request still ran"
    assert running.wait().body["choices"][0]["finish_reason"] == "length"
    c.ok("resume")
    running = start_long_request(emu, max_tokens=60)
    c.ok("drain", mode="retract")
    assert not running.done() and emu.engine()["waiting"] == 1  # preempted into the queue
    c.ok("resume")
    assert running.wait().body["choices"][0]["finish_reason"] == "length"


def test_the_rollout_report_reads_vllms_metrics(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """V-METRIC-PROM: prompt and generated tokens, cached prompt tokens and the prefix-cache hit rate, the
    running and waiting requests, from /metrics, since the resume that opened rollout."""
    emu, agent, _c = vllm_pod(
        start_vllm, start_agent, version, tps=400, agent_args=("--rollout-sample-seconds", "0.1")
    )
    bg = start_long_request(emu, max_tokens=800)  # running while the samples are taken
    for _ in range(3):
        assert emu.complete(" ".join(f"p{i}" for i in range(40)), max_tokens=20).status == 200
    st = agent.wait_state(
        lambda s: (
            (s.get("rollout") or {}).get("promptTokens", 0) >= 3 * 40
            and (s["rollout"].get("meanRunningRequests") or 0) > 0
            and (s["rollout"].get("cacheHitRate") or 0) > 0
        ),
        15,
        "the rollout report",
    )
    ro = st["rollout"]
    assert ro["promptTokens"] >= 3 * 40 and ro["cachedTokens"] >= 2 * 32, ro
    assert 0 < ro["cacheHitRate"] <= 1 and ro["generationTokensPerSecond"] > 0, ro
    assert ro["unmeasured"] == [], ro
    bg.wait()


def test_without_log_stats_the_rollout_says_unmeasured(
    start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    emu, agent, _c = vllm_pod(
        start_vllm, start_agent, NEW, "--disable-log-stats", agent_args=("--rollout-sample-seconds", "0.1")
    )
    assert emu.complete().status == 200
    st = agent.wait_state(lambda s: (s.get("rollout") or {}).get("samples", 0) >= 2, 10, "samples")
    reasons = {u["reason"] for u in st["rollout"]["unmeasured"]}
    assert reasons == {"MetricsDisabled"}, st["rollout"]
    assert "--disable-log-stats" in st["rollout"]["unmeasured"][0]["message"]


# --- guards: what would kill vLLM or make it serve garbage ---------------------------------------------


@pytest.mark.emulator_may_die
def test_serving_after_a_level_two_sleep_needs_a_refit(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """V-KILL-L2-NO-REFIT: a release whose verification failed leaves the pod Drained with its weights
    discarded by the level-2 sleep; the resume is refused (WeightsNotRefitted, nothing sent). The same wake
    sent to vLLM directly resumes scheduling on fresh memory: garbage tokens."""
    emu, agent, c = vllm_pod(start_vllm, start_agent, version)
    c.ok("drain")
    failed = c.failed("release", tags=TAGS, verify={"minFreedBytes": 2**49, "timeoutSeconds": 1})
    assert "cannot free what verify asks" in failed["error"]
    st = agent.state()
    assert st["stage"] == "Drained" and sorted(st["releasedTags"]) == TAGS
    c.refused("resume", "WeightsNotRefitted", _emulator_url=emu.url)
    emu.ok("POST", "/wake_up")  # what the agent refused to send
    out = emu.complete().body["choices"][0]["text"]
    assert GARBAGE in out, out


def test_with_kept_weights_a_drained_pod_resumes(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """--keep-released-weights: a level-1 sleep keeps the weights on the host (V-MEM-LEVEL1-HOST), so the
    same Drained pod resumes on its own weights."""
    emu, _agent, c = vllm_pod(start_vllm, start_agent, version, agent_args=("--keep-released-weights",))
    before = text(emu, "a b c")
    c.ok("drain")
    c.failed("release", tags=TAGS, verify={"minFreedBytes": 2**49, "timeoutSeconds": 1})
    assert emu.engine()["host_backup_bytes"] > 0
    c.ok("resume")
    assert text(emu, "a b c") == before


@pytest.mark.emulator_may_die
def test_a_failed_reload_is_not_served(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """V-KILL-REFIT-FAILED: a reload that fails leaves the layers on the meta device. The refit fails, the
    agent reports why its weights cannot serve and refuses the resume (WeightsNotLoaded), sending vLLM
    nothing; a refit that loads clears it. Without the guard a resume and one request kill vLLM."""
    emu, agent, c = vllm_pod(start_vllm, start_agent, version)
    st = c.failed("refit", version="1", path=str(tmp_path / "no-such-checkpoint"))
    assert "reload_weights" in st["error"]
    st = agent.state()
    assert st["stage"] == "Drained" and "cannot serve until a load completes" in st["engine"]["unloaded"]
    assert emu.engine()["layers_on_meta"] is True
    c.refused("resume", "WeightsNotLoaded", _emulator_url=emu.url)
    c.ok("refit", version="1", path=str(write_model(tmp_path / "v1", "5")))
    assert agent.state()["engine"].get("unloaded") is None
    c.ok("resume")
    assert GARBAGE not in text(emu, "a b c")
    # The same failure, and the resume the agent refused, sent directly:
    emu.ok("POST", "/pause")
    r = emu.call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/nope"}})
    assert r.status == 500
    emu.ok("POST", "/resume")
    emu.call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
    emu.dies()


@pytest.mark.emulator_may_die
def test_the_agent_never_resumes_while_a_part_sleeps(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """V-MEM-WAKE-ORDER, V-KILL-RESUME-ASLEEP with DP 2 (idle ranks would step dummy batches): the refit
    wakes weights only and vLLM stays paused while the reload runs; the resume wakes the KV cache first and
    only then sends /resume. Sent directly, a /resume with the KV cache asleep and one request kill vLLM."""
    log = tmp_path / "calls.jsonl"
    emu, _agent, c = vllm_pod(
        start_vllm, start_agent, version, "-dp", "2", env={"RLJOB_EMULATOR_CALL_LOG": str(log)}
    )
    c.iteration_to_trained("1", str(write_model(tmp_path / "v1", "3")), TAGS)
    c.ok("refit", version="1")
    assert all(
        e["unmapped_tags"] == ["kv_cache"] and e["pause_state"] != "unpaused" for e in emu.stats()["engines"]
    )
    c.ok("resume")
    routes = [json.loads(line).get("route") for line in log.read_text().splitlines()]
    routes = [r for r in routes if r in ("/wake_up", "/resume", "/collective_rpc")]
    assert routes[-4:] == ["/wake_up", "/collective_rpc", "/wake_up", "/resume"], routes
    assert GARBAGE not in text(emu, "a b")
    emu.ok("POST", "/pause")
    emu.ok("POST", "/sleep?level=1")
    emu.ok("POST", "/wake_up?tags=weights")
    emu.ok("POST", "/resume")  # what the agent never sends while kv_cache sleeps
    emu.call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
    emu.dies()


def test_tensor_pushes_vllm_would_fail_on_are_refused(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """V-KILL-REFIT-FAILED: an update that fails after the session's start leaves layers unbuilt. The
    agent refuses (422 InvalidPush, nothing sent) the updates vLLM would fail on: sizes that are not the
    shapes', handles that are not a pickle, `packed` false, a GPU set smaller than vLLM's workers."""
    emu, agent, c = vllm_pod(start_vllm, start_agent, version, *IPC, env=INSECURE)
    c.iteration_to_trained("1", None, TAGS)
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    assert agent.trainer("GET", "/v1/trainer/refit?wait=10").body["open"]
    name = "model.layers.0.mlp.weight"
    good = vllm_update({name: make_tensors("7", 16 << 10)[name]})
    bad = {
        "tensor_sizes": {**good, "tensor_sizes": [good["tensor_sizes"][0] - 4]},
        "not a pickle": {**good, "ipc_handles_pickled": "bm90IGEgcGlja2xl"},
        "packed false": {**good, "packed": False},
        "serialized form": None,
    }
    updates_before = emu.stats()["calls"].get("/update_weights", 0)
    for why, info in bad.items():
        body = {"updateInfo": info} if info is not None else {"serializedNamedTensors": ["eA=="]}
        r = agent.trainer("POST", "/v1/trainer/refit/tensor", body)
        assert r.status == 422 and r.body["error"] == "InvalidPush", (why, r.text)
    assert emu.stats()["calls"].get("/update_weights", 0) == updates_before
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", {"updateInfo": good, "last": True})
    assert r.status == 200, r.text
    agent.trainer("POST", "/v1/trainer/refit/close", {})
    agent.wait_stage("Refitted")


@pytest.mark.emulator_may_die
def test_an_update_vllm_fails_on_kills_the_next_forward(version: str, start_vllm: StartVllm) -> None:
    """What the push guard prevents, sent to vLLM directly: tensor sizes that are not the shapes' fail the
    update inside the session; the layers stay on the meta device and the next request kills vLLM."""
    emu = start_vllm(version, *IPC, env=INSECURE)
    name = "model.layers.0.mlp.weight"
    good = vllm_update({name: make_tensors("7", 16 << 10)[name]})
    info = {**good, "tensor_sizes": [good["tensor_sizes"][0] - 4]}
    init = {"packed": True} if version == NEW else {}
    emu.ok("POST", "/init_weight_transfer_engine", {"init_info": init})
    emu.ok("POST", "/start_weight_update")
    r = emu.call(
        "POST", "/update_weights", {"update_info": info if version == NEW else {**info, "packed": True}}
    )
    assert r.status == 500, r.text
    emu.call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
    emu.dies()


@pytest.mark.emulator_may_die
def test_a_sleep_that_failed_fails_the_pod(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """V-KILL-SLEEP-ASSERT: a sleep that answers 500 may have unmapped memory that vLLM's executor believes
    mapped; the agent fails the pod (StateUnknown) instead of ever waking it. Sent directly, the next wake
    maps nothing, resumes scheduling, and a request kills vLLM."""
    emu, agent, c = vllm_pod(start_vllm, start_agent, version, "--fault-sleep-memory-grows")
    c.ok("drain")
    r = c.send("release", tags=TAGS)
    assert r.status == 200 and r.body["state"] == "Failed", r.body
    st = agent.wait_stage("Failed")
    assert "V-KILL-SLEEP-ASSERT" in st["fatal"], st["fatal"]
    emu.ok("POST", "/wake_up")
    emu.call("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=10)
    emu.dies()


def test_releases_vllm_cannot_make_are_refused(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """cuda_graph stays on the GPU (V-MEM-RESIDENT); weights have no route of their own; the KV cache alone
    only from 0.34 (V-MEM-RELEASE-KV). Each a permanent refusal, nothing sent."""
    emu, _agent, c = vllm_pod(start_vllm, start_agent, version)
    c.ok("drain")
    for tags in (["kv_cache", "weights", "cuda_graph"], ["weights"]):
        r = c.refused("release", "ReleaseTagUnsupported", tags=tags, _emulator_url=emu.url)
        assert r["permanent"] is True
    if version == NEW:
        c.ok("release", tags=["kv_cache"])
        assert emu.engine()["unmapped_tags"] == ["kv_cache"]
        c.ok("grant")
        c.publish("1", str(write_model(Path(emu.log.parent) / "v1", "3")))
        c.ok("refit", version="1")
        c.ok("resume")
        assert GARBAGE not in text(emu, "a b")
    else:
        c.refused("release", "ReleaseTagUnsupported", tags=["kv_cache"], _emulator_url=emu.url)


def test_a_distributed_refit_is_refused_for_good(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    emu, _agent, c = vllm_pod(
        start_vllm, start_agent, version, "--weight-transfer-config", '{"backend": "nccl"}'
    )
    c.iteration_to_trained("1", None, TAGS)
    r = c.refused(
        "refit", "DistributedRefitUnsupported", version="1", source="distributed", _emulator_url=emu.url
    )
    assert r["permanent"] is True and "V-KILL-NCCL-ALONE" in r["reason"]


# --- launch refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "env", "agent_args", "reason"),
    [
        pytest.param((), {}, ("--refit-source", "tensor"), "TensorTransferUnconfigured", id="no-ipc-backend"),
        pytest.param(
            IPC, {}, ("--refit-source", "tensor"), "TensorTransferUnconfigured", id="no-insecure-env"
        ),
        pytest.param(("--host", "0.0.0.0", *IPC), INSECURE, (), "InsecureEngineExposed", id="exposed"),
    ],
)
def test_launches_under_which_the_handoff_is_unsafe_are_refused(
    flags: tuple[str, ...],
    env: dict[str, str],
    agent_args: tuple[str, ...],
    reason: str,
    start_vllm: StartVllm,
    start_agent: StartAgent,
) -> None:
    _emu, agent, _c = vllm_pod(
        start_vllm, start_agent, NEW, *flags, env=env, agent_args=agent_args, serving=False
    )
    st = agent.wait_stage("Ready")
    refusal = st["engine"]["launchRefusal"]
    assert refusal is not None and refusal["reason"] == reason, st["engine"]


def test_without_sleep_mode_a_release_would_free_nothing(
    version: str, start_vllm: StartVllm, start_agent: StartAgent
) -> None:
    """V-KILL-NO-SLEEP-MODE: the launch refusal, and the release refused for good; sent directly, the sleep
    answers 200 and frees nothing."""
    emu, agent, c = vllm_pod(start_vllm, start_agent, version, sleep_mode=False)
    assert agent.state()["engine"]["launchRefusal"]["reason"] == "ReleaseFreesNothing"
    c.ok("drain")
    assert c.refused("release", "ReleaseFreesNothing", tags=TAGS, _emulator_url=emu.url)["permanent"]
    used = emu.call("GET", "/_emulator/memory").body["gpus"][0]["used_bytes"]
    emu.ok("POST", "/sleep?level=2")
    assert emu.call("GET", "/_emulator/memory").body["gpus"][0]["used_bytes"] == used


def test_without_dev_mode_nothing_is_sent(start_vllm: StartVllm, start_agent: StartAgent) -> None:
    """V-LAUNCH-DEVMODE: no RL route exists; the agent reports it and refuses every command for good."""
    _emu, agent, c = vllm_pod(start_vllm, start_agent, NEW, dev_mode=False, serving=False)
    st = agent.wait_stage("Ready")
    assert st["engine"]["launchRefusal"]["reason"] == "LifecycleRoutesDisabled"
    assert c.refused("drain", "LifecycleRoutesDisabled")["permanent"] is True


# --- recovery -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("restart_at", ["Released", "Refitted"])
def test_a_restarted_agent_continues_the_cycle(
    restart_at: str,
    version: str,
    start_vllm: StartVllm,
    start_agent: StartAgent,
    procs: list[Any],
    tmp_path: Path,
) -> None:
    """The agent killed mid-cycle (after the release; after the refit) and started again on its record:
    it recovers (the release proven by freed GPU memory; vLLM 0.26's label from the record, 0.34's from
    /weight_info) and the cycle goes on without a call made twice."""
    state_dir = tmp_path / "state"
    args = ("--state-dir", str(state_dir))
    emu, agent, c = vllm_pod(start_vllm, start_agent, version, agent_args=args)
    path = str(write_model(tmp_path / "v1", "3"))
    c.ok("drain")
    c.ok("release", tags=TAGS)
    if restart_at == "Refitted":
        c.ok("grant")
        c.publish("1", path)
        c.ok("refit", version="1")
    agent.popen.kill()
    agent.wait_exit(10)
    again = start_agent(emu, "--engine", "vllm", *args, serving=False)
    st = again.wait_state(lambda s: s["recovery"]["state"] == "Recovered", 15, "recovery")
    assert st["stage"] == restart_at, st
    c2 = AgentDriver(again)
    if restart_at == "Released":
        c2.ok("grant")
        c2.publish("1", path)
        c2.ok("refit", version="1")
    c2.ok("resume")
    st = again.state()
    assert st["stage"] == "Serving" and st["engine"]["servedVersion"] == "1"
    assert GARBAGE not in text(emu, "a b c")
    assert json.loads(http("GET", emu.url + "/_emulator/calls").text)["repeats"] == []
    wait_until(lambda: True, 1, "")


def test_an_agent_restarted_before_it_saw_vllm_starts_at_the_launch_label(
    version: str, start_vllm: StartVllm, start_agent: StartAgent, tmp_path: Path
) -> None:
    """The agent killed while vLLM still loads (its record at Starting) and started again: nothing was loaded
    since launch, so it serves the launch label as a fresh agent would. Were the label taken from the
    record (none yet on 0.26), the operator would reload the initial weights into every pod of the gang."""
    args = ("--engine", "vllm", "--state-dir", str(tmp_path / "state"))
    emu = start_vllm(version, "--startup-seconds", "4")
    agent = start_agent(emu, *args, serving=False)
    assert agent.state()["stage"] == "Starting"
    agent.popen.kill()
    agent.wait_exit(10)
    again = start_agent(emu, *args, serving=False)
    st = again.wait_state(lambda s: s["recovery"]["state"] == "Recovered", 30, "recovery")
    assert st["stage"] == "Ready" and st["engine"]["servedVersion"] == "default", st
