"""The conductor turns every refusal into one Failed/InvalidSpec status through decide(), within one
reconcile and without raising (a raise would make kopf retry the daemon): the spec the models refuse,
a child the API server refuses in a dry run, and one it refuses at creation. A fake Kube records the
calls; decide() and the status writer are the real ones."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import yaml

from rljob.api import parse_status
from rljob.controller.children import Refusal
from rljob.controller.conductor import Conductor, ConductorOptions
from rljob.controller.kube import ChildRefused

ROOT = Path(__file__).resolve().parents[2]
INVALID_PULL_POLICY = {
    "message": 'Pod "demo-1" is invalid: spec.containers[0].imagePullPolicy: Unsupported value: "Sometimes"',
    "details": {
        "causes": [
            {"field": "spec.containers[0].imagePullPolicy", "message": 'Unsupported value: "Sometimes"'}
        ]
    },
}


class FakeKube:
    def __init__(self, refuse_dry_run: bool = False, refuse_create: bool = False) -> None:
        self.refuse_dry_run, self.refuse_create = refuse_dry_run, refuse_create
        self.status: dict[str, Any] = {}
        self.patches: list[dict[str, Any]] = []
        self.created: list[tuple[str, str, bool]] = []  # (kind, name, dry run)
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message)
        self.on_patch = lambda: None

    async def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return []

    async def read_status(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.status)

    async def read_token(self, namespace: str, job: str) -> str | None:
        return "token" if any(kind == "Secret" for kind, _, _ in self.created) else None

    async def create(self, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False) -> bool:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if kind == "Pod" and (self.refuse_dry_run if dry_run else self.refuse_create):
            raise ChildRefused(Refusal.from_status(kind, name, INVALID_PULL_POLICY))
        self.created.append((kind, name, dry_run))
        return True

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)
        self.status = apply(self.status, patch)
        self.on_patch()

    async def post_event(self, namespace: str, job: Any, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        pass

    async def delete_job(self, namespace: str, name: str) -> None:
        pass


def apply(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = apply(out[key], value)
        else:
            out[key] = value
    return out


def body(edit: Any = None, name: str = "demo") -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
    if edit is not None:
        edit(doc)
    doc["metadata"] = {"name": name, "namespace": "ns", "uid": "uid-1", "generation": 1}
    return doc


def conduct(kube: FakeKube, job: dict[str, Any], rounds_after_failed: int = 2) -> dict[str, Any]:
    """Run the conductor until it wrote Failed and did `rounds_after_failed` more rounds."""
    options = ConductorOptions(tick_seconds=0.01, quiet_seconds=0.01)
    conductor = Conductor(kube, job, options)  # type: ignore[arg-type]
    failed_at: list[int] = []

    def patched() -> None:
        if kube.status.get("phase") == "Failed" and not failed_at:
            failed_at.append(len(kube.patches))

    kube.on_patch = patched
    rounds = 0

    def stopped() -> bool:
        nonlocal rounds
        rounds += 1 if failed_at else 0
        return rounds > rounds_after_failed

    asyncio.run(asyncio.wait_for(conductor.run(stopped), 10))
    assert failed_at, kube.patches
    return kube.status


def assert_invalid_spec(kube: FakeKube, status: dict[str, Any], field: str) -> None:
    assert status["phase"] == "Failed" and status["reason"] == "InvalidSpec", status
    assert f"{field}: " in status["message"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Failed"] == "True" and conditions["Ready"] == "False"
    assert len(kube.patches) == 1, (
        kube.patches
    )  # the first write is the final one; later rounds write nothing
    assert parse_status(status).phase.terminal
    assert [(t, r) for t, r, _ in kube.events] == [("Warning", "InvalidSpec")], kube.events
    assert not [c for c in kube.created if c[0] == "Pod" and not c[2]]  # no pod was made


def test_a_spec_the_models_refuse_fails_in_the_first_round_and_creates_nothing() -> None:
    kube = FakeKube()
    job = body(lambda d: d["spec"]["template"]["spec"]["containers"].append({"name": "rljob-agent"}))
    status = conduct(kube, job)
    assert_invalid_spec(kube, status, "spec.template.spec.containers")
    assert kube.created == []  # not even the token Secret or the Service


def test_a_name_the_children_cannot_carry_fails_without_any_child() -> None:
    kube = FakeKube()
    status = conduct(kube, body(name="a.b"))
    assert_invalid_spec(kube, status, "metadata.name")
    assert kube.created == []


def test_a_pod_refused_in_the_dry_run_fails_before_any_pod_is_created() -> None:
    kube = FakeKube(refuse_dry_run=True)
    status = conduct(kube, body())
    assert_invalid_spec(kube, status, "spec.template.spec.containers[0].imagePullPolicy")
    assert [k for k, _, _ in kube.created] == ["Secret", "Service"]


def test_a_pod_refused_at_creation_fails_the_next_round() -> None:
    kube = FakeKube(refuse_create=True)
    conduct(kube, body())
    status = kube.status
    assert status["phase"] == "Failed" and status["reason"] == "InvalidSpec", status
    assert "spec.template.spec.containers[0].imagePullPolicy: " in status["message"]
    assert ("Pod", "demo-1", True) in kube.created  # the dry run passed; the create did not
    assert [r for _, r, _ in kube.events].count("InvalidSpec") == 1


def test_a_conductor_started_again_takes_the_stored_status_not_kopfs_older_body() -> None:
    """kopf starts a conductor again after it raised (a status write answered 504) from its body of the
    job, which under load was transitions behind; the stored status is the one to go on from."""
    kube = FakeKube(refuse_dry_run=True)
    stale = body()  # kopf's body from before the first write: no status
    conduct(kube, copy.deepcopy(stale))
    assert kube.status["phase"] == "Failed"
    patches, created, events = len(kube.patches), list(kube.created), list(kube.events)

    calls = 0

    def stopped() -> bool:
        nonlocal calls
        calls += 1
        return calls > 5

    options = ConductorOptions(tick_seconds=0.01, quiet_seconds=0.01)
    asyncio.run(asyncio.wait_for(Conductor(kube, stale, options).run(stopped), 10))  # type: ignore[arg-type]
    assert calls > 5  # it ran its rounds
    assert len(kube.patches) == patches, kube.patches[patches:]  # nothing written back over Failed
    assert kube.events == events  # no second InvalidSpec
    assert not [c for c in kube.created[len(created) :] if c[0] == "Pod"]  # not even a dry run
