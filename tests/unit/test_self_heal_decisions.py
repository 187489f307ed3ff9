"""Pure pieces of the self-healing agent: the pod layout (native sidecar or regular container), the
server-version choice, broken_reason for a restarted sidecar, the agent's record and store round trip,
and the emulator's repeat counting."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_children import demo_spec

from rljob.agent.record import AgentRecord, Intent, RecordError
from rljob.agent.state import StateStore
from rljob.api import parse_spec
from rljob.api.agent import (
    CommandState,
    CommandStatus,
    RecoveryState,
    ReleaseCommand,
    Stage,
)
from rljob.api.spec import AGENT_CONTAINER, DrainMode, ReleaseTag
from rljob.controller.children import (
    STATE_DIR,
    STATE_VOLUME,
    AgentOptions,
    gang_pod,
    native_sidecars_supported,
)
from rljob.controller.observe import broken_reason
from rljob.emulator.call_log import CallLog
from rljob.testing.harness import ROOT

# --- the pod ---------------------------------------------------------------------------------------


def test_native_sidecar_layout() -> None:
    pod = gang_pod("demo", "u", demo_spec(), 0, 0, AgentOptions(native_sidecar=True), None)
    spec = pod["spec"]
    assert [c["name"] for c in spec["containers"]] == ["sglang", "trainer"]
    (agent,) = spec["initContainers"]
    assert agent["name"] == AGENT_CONTAINER and agent["restartPolicy"] == "Always"
    assert spec["restartPolicy"] == "Never"  # SGLang and the trainer still never restart
    assert agent["args"][agent["args"].index("--state-dir") + 1] == STATE_DIR
    assert {"name": STATE_VOLUME, "mountPath": STATE_DIR} in agent["volumeMounts"]
    volume = next(v for v in spec["volumes"] if v["name"] == STATE_VOLUME)
    assert volume["emptyDir"]["medium"] == "Memory"  # the record costs no disk write


def test_regular_container_layout_keeps_the_record_too() -> None:
    pod = gang_pod("demo", "u", demo_spec(), 0, 0, AgentOptions(), None)
    agent = pod["spec"]["containers"][-1]
    assert agent["name"] == AGENT_CONTAINER and "restartPolicy" not in agent
    assert "initContainers" not in pod["spec"]
    assert "--state-dir" in agent["args"]


def test_a_template_init_container_runs_before_the_agent() -> None:
    doc = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
    doc["spec"]["template"]["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox"}]
    pod = gang_pod("demo", "u", parse_spec(doc["spec"]), 0, 0, AgentOptions(native_sidecar=True), None)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch", AGENT_CONTAINER]


@pytest.mark.parametrize(
    ("version", "native"),
    [
        ("v1.34.4", True),
        ("v1.33.0", True),
        ("v1.33.1-eks-abc", True),
        ("v2.0.0", True),
        ("v1.32.9", False),  # beta: the gate may be off, and then the pod never starts
        ("v1.29.0", False),
        ("1.28", False),
        ("garbage", False),
    ],
)
def test_native_sidecars_need_a_1_33_server(version: str, native: bool) -> None:
    assert native_sidecars_supported(version) is native


def _pod(containers: list[dict[str, Any]], inits: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {"name": "j-0"},
        "status": {"phase": "Running", "containerStatuses": containers, "initContainerStatuses": inits},
    }


RUNNING = {"name": "sglang", "state": {"running": {}}, "restartCount": 0}


def test_a_restarted_sidecar_agent_is_not_a_lost_member() -> None:
    waiting = {"waiting": {"reason": "CrashLoopBackOff"}}
    crashed = {"name": AGENT_CONTAINER, "restartCount": 3, "state": waiting}
    assert broken_reason(_pod([RUNNING], [crashed])) is None
    back = {"name": AGENT_CONTAINER, "restartCount": 3, "state": {"running": {}}}
    assert broken_reason(_pod([RUNNING], [back])) is None


def test_a_regular_agent_container_that_exited_is_a_lost_member() -> None:
    exited = {"name": AGENT_CONTAINER, "restartCount": 0, "state": {"terminated": {"exitCode": 137}}}
    expected = f"container {AGENT_CONTAINER} terminated (exit 137, )"
    assert broken_reason(_pod([RUNNING, exited], [])) == expected


# --- the record ------------------------------------------------------------------------------------


def test_record_round_trip_is_atomic(tmp_path: Path) -> None:
    record = AgentRecord(tmp_path / "state")
    assert record.load() is None
    record.save({"boots": 1, "x": [1, 2]})
    assert record.load() == {"format": 1, "boots": 1, "x": [1, 2]}
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["agent-record.json"]  # no temp file left
    record.path.write_text("{half")
    with pytest.raises(RecordError):
        record.load()
    record.path.write_text(json.dumps({"format": 99}))
    with pytest.raises(RecordError, match="unknown record format"):
        record.load()


def test_intent_round_trip() -> None:
    intent = Intent(
        "release",
        7,
        ("kv_cache", "weights"),
        used_before={0: 10, 1: 20},
        at=1.5,
        named="release_memory_occupation",
    )
    assert Intent.from_wire(json.loads(json.dumps(intent.wire()))) == intent
    assert intent.describe() == "release_memory_occupation(kv_cache, weights) at epoch 7"


def test_store_restore_continues_the_recorded_state(tmp_path: Path) -> None:
    async def scenario() -> None:
        record = AgentRecord(tmp_path)
        first = StateStore(record=record)
        release = ReleaseCommand(epoch=5, tags=[ReleaseTag.KV_CACHE])
        first.command = release
        first.pause_mode = DrainMode.RETRACT
        first.release_before = {0: 1000}
        first.lease_epoch = 4
        with first.change() as s:
            s.stage = Stage.DRAINED
            s.epoch = 5
            s.last_command = CommandStatus(epoch=5, action=release.action, state=CommandState.RUNNING)
        first.announce(Intent("release", 5, ("kv_cache",), used_before={0: 1000}))
        saved = record.load()
        assert saved is not None and saved["intent"]["call"] == "release"  # on disk before the call

        second = StateStore(record=record)
        second.restore(saved)
        st = second.state
        assert st.boot_id != first.state.boot_id
        assert (st.stage, st.epoch, st.revision) == (Stage.DRAINED, 5, first.state.revision)
        assert st.recovery.state == RecoveryState.RECOVERING and st.recovery.restarts == 1
        assert second.boots == 2 and second.command == release and second.lease_epoch == 4
        assert second.pause_mode == DrainMode.RETRACT and second.release_before == {0: 1000}
        assert second.intent is not None and second.intent.tags == ("kv_cache",)
        with second.outcome() as s:
            s.released_tags = [ReleaseTag.KV_CACHE]
        again = record.load()
        assert again is not None and again["intent"] is None
        assert again["state"]["releasedTags"] == ["kv_cache"]

        second.unsure("x was announced")
        assert second.state.stage == Stage.FAILED and second.state.fatal == "StateUnknown: x was announced"
        assert second.state.last_command is not None
        assert second.state.last_command.state == CommandState.FAILED

    asyncio.run(scenario())


def test_a_call_that_cannot_be_recorded_is_not_made(tmp_path: Path) -> None:
    from rljob.agent.errors import CommandFailed

    async def scenario() -> None:
        blocked = tmp_path / "file"
        blocked.write_text("")
        store = StateStore(record=AgentRecord(blocked / "under-a-file"))
        with pytest.raises(CommandFailed, match="cannot record"):
            store.announce(Intent("resume", 3, ("weights",)))
        assert store.intent is None

    asyncio.run(scenario())


# --- the emulator's repeat counting ----------------------------------------------------------------


def _body(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def test_call_log_counts_repeats_of_non_idempotent_calls() -> None:
    log = CallLog()
    log.record("/pause_generation", _body(mode="abort"))
    log.record("/pause_generation", _body(mode="abort"))  # idempotent: never a repeat
    log.record("/release_memory_occupation", _body(tags=["weights", "kv_cache"]))
    log.record("/resume_memory_occupation", _body(tags=["weights"]))
    log.record("/update_weights_from_disk", _body(model_path="/w1", weight_version="1"))
    log.record("/resume_memory_occupation", _body(tags=["kv_cache"]))
    assert log.repeats == []
    log.record("/release_memory_occupation", _body(tags=["kv_cache"]))
    log.record("/release_memory_occupation", _body(tags=["kv_cache"]))  # no resume in between
    log.record("/resume_memory_occupation", _body(tags=["kv_cache"]))
    log.record("/resume_memory_occupation", _body(tags=["kv_cache"]))  # a second resume of a resumed tag
    log.record("/update_weights_from_disk", _body(model_path="/w1", weight_version="1"))
    whys = [(r["route"], r["why"]) for r in log.repeats]
    assert whys == [
        ("/release_memory_occupation", "kv_cache released again with no resume in between"),
        ("/resume_memory_occupation", "kv_cache resumed while not released"),
        ("/update_weights_from_disk", "weight_version 1 loaded again"),
    ]
    report = log.report()
    assert report["routes"]["/release_memory_occupation"] == 3
    counted = {(c["route"], c["args"]): c["count"] for c in report["calls"]}
    assert counted[("/release_memory_occupation", "kv_cache")] == 2
    assert counted[("/pause_generation", "")] == 2


def _query(**kw: str) -> bytes:
    """What the vLLM emulator logs for a call without a body: its query parameters, each a list."""
    return json.dumps({k: [v] for k, v in kw.items()}).encode()


def test_call_log_counts_repeats_of_vllms_non_idempotent_calls() -> None:
    log = CallLog()
    log.record("/pause", _query(mode="abort"))
    log.record("/pause", _query(mode="abort"))  # idempotent: never a repeat
    log.record("/sleep", _query(level="2"))
    log.record("/wake_up", _query(tags="weights"))
    log.record("/collective_rpc", _body(method="reload_weights", kwargs={"weights_path": "/w/1"}))
    log.record("/wake_up", _query(tags="kv_cache"))
    log.record("/sleep", _query(level="0"))  # a pause: nothing sleeps
    log.record("/start_weight_update", b"")
    log.record("/update_weights", _body(update_info={"names": ["a"]}))
    log.record("/finish_weight_update", _body(weight_version="2"))
    assert log.repeats == []
    log.record("/sleep", _query(level="1"))
    log.record("/sleep", _query(level="1"))  # no wake in between: vLLM skips it
    log.record("/wake_up", b"")  # every tag asleep
    log.record("/wake_up", b"")  # nothing asleep
    log.record("/wake_up", _query(tags="weights"))
    log.record("/collective_rpc", _body(method="reload_weights", kwargs={"weights_path": "/w/1"}))
    log.record("/finish_weight_update", _body(weight_version="2"))
    whys = [(r["route"], r["why"]) for r in log.repeats]
    assert whys == [
        ("/sleep", "kv_cache, weights slept again with no wake in between"),
        ("/wake_up", "every tag woken while not asleep"),
        ("/wake_up", "weights woken while not asleep"),
        ("/collective_rpc", "/w/1 loaded again"),
        ("/finish_weight_update", "weight_version 2 loaded again"),
    ]
    counted = {(c["route"], c["args"]): c["count"] for c in log.report()["calls"]}
    assert counted[("/sleep", "level=1")] == 2 and counted[("/pause", "")] == 2
