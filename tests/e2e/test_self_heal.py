"""The agent heals itself: it runs as a native sidecar (the operator saw a 1.34 API server), so the fake
kubelet restarts it without ending the pod, and it continues from its pod-local record. Killed during
Releasing, Training and Refitting (each while its SGLang call is in flight: every lifecycle route is slowed
down), the job still succeeds with no gang restart, every SGLang process is the original one, and no
non-idempotent call reached SGLang twice."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
import urllib.request
from typing import Any

import pytest
from test_operator import RL, SLOW, assert_monotonic, crd, job, rl, versions  # noqa: F401  (fixtures)

from rljob.controller.children import AGENT_CONTAINER, token_secret_name
from rljob.testing.harness import wait_rljob
from rljob.testing.kubelet import Kubelet

pytestmark = pytest.mark.e2e

# (iteration, phase, the SGLang route whose arrival times the kill: while it is in flight, slowed by SLOW)
# From iteration 2: the test looks at the pods between the first Rollout and its first kill, and on a
# loaded machine iteration 1's Releasing (~0.6 s) can pass meanwhile. Each is "from" that iteration: a poll
# that misses a phase (a GET on a loaded API server takes longer than it lasts) takes it in a later
# iteration, of which the job has ITERATIONS - 4 to spare, rather than waiting for one that went by.
ITERATIONS = 7
KILLS = [
    (2, "Releasing", "/release_memory_occupation"),
    (3, "Training", None),  # the trainer holds the GPU lease
    (4, "Refitting", "/update_weights_from_disk"),
]
VICTIM = "heal-1"


def agent_status(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["status"].get("initContainerStatuses") or [] if c["name"] == AGENT_CONTAINER)


def kill_agent(kubelet: Kubelet, namespace: str, pod: str) -> int:
    runner = kubelet.runner(namespace, pod)
    assert runner is not None
    proc = runner.processes()[AGENT_CONTAINER]
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.pid


def agent_state(world: RL, pod: dict[str, Any]) -> dict[str, Any]:
    job_name = pod["metadata"]["labels"]["rljob.io/job"]
    secret = world.api.get(f"/api/v1/namespaces/{world.namespace}/secrets/{token_secret_name(job_name)}")
    token = base64.b64decode(secret["data"]["token"]).decode()
    req = urllib.request.Request(
        f"http://{pod['status']['podIP']}:8471/v1/state", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        return dict(json.loads(resp.read()))


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll `predicate` (an agent that is down, restarting, counts as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:  # urllib's errors included
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def pod_named(world: RL, name: str) -> dict[str, Any]:
    return next(p for p in world.pods("heal") if p["metadata"]["name"] == name)


def test_agent_killed_in_releasing_training_refitting_heals_without_a_gang_restart(rl: RL) -> None:  # noqa: F811
    rl.apply(job("heal", iterations=ITERATIONS, sim_args=SLOW, train_seconds=1.0))
    obj = rl.wait("heal", "Rollout", timeout=120)
    pods = {p["metadata"]["name"]: p for p in rl.pods("heal")}
    for pod in pods.values():  # the operator chose the native sidecar on this 1.34 server
        assert [c["name"] for c in pod["spec"]["initContainers"]] == [AGENT_CONTAINER]
        assert pod["spec"]["initContainers"][0]["restartPolicy"] == "Always"
    sglang = {name: rl.emulator(p, "/_emulator/calls") for name, p in pods.items()}
    killed: list[int] = []
    victim = pods[VICTIM]
    for iteration, phase, route in KILLS:
        seen = wait_rljob(
            rl.api,
            rl.namespace,
            "heal",
            lambda o, i=iteration, p=phase: (
                (o.get("status", {}).get("iteration") or 0) >= i and o["status"].get("phase") == p
            ),
            120,
            f"{phase} of iteration {iteration} or later",
            poll=0.02,
            on_timeout=rl.operator.log_tail,
        )
        if route is not None:  # the call is on its way to SGLang: the agent dies before its answer
            sent = rl.emulator(victim, "/_emulator/calls")["routes"].get(route, 0)
            wait_for(
                lambda r=route, n=sent: rl.emulator(victim, "/_emulator/calls")["routes"].get(r, 0) > n,
                30,
                f"{route} in {phase}",
            )
        killed.append(kill_agent(rl.kubelet, rl.namespace, VICTIM))
        # The kubelet starts it again: the pod stays, its restart count goes up, and it recovers.
        restarts = len(killed)
        wait_for(lambda n=restarts: agent_status(pod_named(rl, VICTIM))["restartCount"] == n, 30, "restart")
        wait_for(
            lambda n=restarts: (
                (st := agent_state(rl, victim)["recovery"])["restarts"] == n and st["state"] != "Recovering"
            ),
            60,
            "recovery",
        )
        recovery = agent_state(rl, victim)["recovery"]
        where = f"{phase} of iteration {seen['status']['iteration']} (epoch {seen['status']['epoch']})"
        print(f"agent of {VICTIM} killed in {where}: {recovery['state']}: {recovery.get('detail')}")
        assert recovery["state"] == "Recovered", recovery
    obj = rl.wait("heal", "Succeeded", timeout=180)
    status = obj["status"]
    assert status["restarts"] == 0, status.get("message")  # no gang restart
    assert status["weightVersion"] == str(ITERATIONS)
    assert versions(obj) == [str(v) for v in range(ITERATIONS + 1)]
    assert_monotonic(versions(obj))
    events = {e["reason"] for e in rl.events("heal")}
    assert "GangMemberLost" not in events, events
    for pod in rl.pods("heal"):
        name = pod["metadata"]["name"]
        assert pod["metadata"]["uid"] == pods[name]["metadata"]["uid"]  # the same pods
        statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
        assert statuses["sglang"]["restartCount"] == 0 and "running" in statuses["sglang"]["state"]
        calls = rl.emulator(pod, "/_emulator/calls")
        # The original SGLang process, and no release, resume or refit it received twice.
        assert (calls["pid"], calls["bootId"]) == (sglang[name]["pid"], sglang[name]["bootId"])
        assert calls["repeats"] == [], calls["repeats"]
        assert rl.emulator(pod, "/model_info")["weight_version"] == str(ITERATIONS)
        restarts = agent_status(pod)["restartCount"]
        state = agent_state(rl, pod)
        assert restarts == (len(KILLS) if name == VICTIM else 0)
        assert state["recovery"]["restarts"] == restarts
        assert state["recovery"]["state"] == ("Recovered" if restarts else "Fresh"), state["recovery"]
        print(f"{name}: agent restarts {restarts}, recovery {state['recovery']}")
