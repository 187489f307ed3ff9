"""A vLLM-based framework's own HTTP sequence through the agent's vLLM-compatible endpoint
(agent/engines/vllm/endpoint.py): SkyRL's colocated iteration at commit a9564572
(tests/replays/vllm/skyrl.json, docs/vllm-conformance.md §11), replayed step by step with the bodies
SkyRL's aiohttp client writes, two iterations, against the vLLM emulator at each recorded version. This
test plays the operator: it drains, releases and grants when the framework's sleep asks for the GPU,
refits when its weight update published, resumes once refitted. Every reply must be what real vLLM
answers and SkyRL reads."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Agent, AgentDriver, Reply, free_port, http
from vllm_procs import GARBAGE, UUID0, VLLM_VERSIONS, VllmEmulator

from rljob.testing.ipc_stand_in import share
from rljob.testing.trainer import make_tensors
from rljob.trainer.engines.sglang import packing as stand_in_pickle

REPLAY = Path(__file__).resolve().parents[1] / "replays" / "vllm" / "skyrl.json"
TAGS = ["kv_cache", "weights"]
REBUILD = stand_in_pickle.Global("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


def skyrl_chunk(arrays: dict[str, Any], shared: Path) -> dict[str, Any]:
    """One chunk as cuda_ipc_strategy.py:198-250@a9564572 builds it: the tensors packed into one buffer of
    the model's dtype, `sizes` in elements, handles `{gpu_uuid: reduce_tensor(packed)}` (the rebuild
    function and its args) pickled and base64'ed."""
    data = b"".join(a.tobytes() for a in arrays.values())
    numel = sum(int(a.size) for a in arrays.values())
    reduction = share(data, shared, dtype="float32", shape=(numel,))
    handles = {UUID0: (REBUILD, reduction.args)}
    return {
        "names": list(arrays),
        "dtype_names": ["float32"] * len(arrays),
        "shapes": [list(a.shape) for a in arrays.values()],
        "sizes": [int(a.size) for a in arrays.values()],
        "ipc_handles_pickled": base64.b64encode(stand_in_pickle.dumps(handles)).decode("utf-8"),
    }


def send(url: str, step: dict[str, Any], body: Any) -> Reply:
    query = urllib.parse.urlencode([tuple(pair) for pair in step["query"]])
    return http(step["method"], url + step["path"] + (f"?{query}" if query else ""), body, timeout=60)


def check(step: dict[str, Any], r: Reply) -> None:
    want = step["expect"]
    assert r.status == want["status"], f"{step['name']} ({step['cite']}): {r.status} {r.text}"
    for path, kind in want.get("reads", {}).items():
        value: Any = r.body
        for part in path.replace("[0]", ".0").split("."):
            value = value[int(part)] if part.isdigit() else value[part]
        assert type(value).__name__ == kind, f"{step['name']}: {path} is {value!r}, SkyRL reads a {kind}"


class Operator:
    """The operator's side of the lock-step for one pod, in a thread: every command at the moment the
    agent's state asks for it."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.driver = AgentDriver(agent)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        c = self.driver
        try:
            while not self._stop.is_set():
                st = self.agent.state()
                stage, trainer = st["stage"], st["trainer"]
                if stage == "Serving" and trainer.get("requested") and not trainer.get("leaseHeld"):
                    c.ok("drain")
                    c.ok("release", tags=TAGS)
                    c.ok("grant")
                elif stage == "Trained" and st.get("lastCommand", {}).get("action") != "refit":
                    c.epoch += 1
                    r = self.agent.command(
                        "refit", c.epoch, wait=0, version=trainer["publishedVersion"], source="tensor"
                    )
                    assert r.status == 202, r.text
                elif stage == "Refitted":
                    c.ok("resume")
                elif stage == "Failed":
                    raise AssertionError(f"the agent failed: {st.get('fatal')}")
                time.sleep(0.02)
        except Exception as e:  # reported by the test's thread
            self.errors.append(f"{e.__class__.__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_skyrl_colocated_sequence_through_the_endpoint(
    version: str,
    start_vllm: Callable[..., VllmEmulator],
    start_agent: Callable[..., Agent],
    tmp_path: Path,
) -> None:
    seq = json.loads(REPLAY.read_text())
    shared = tmp_path / "ipc"
    launch = seq["launch"]
    emu = start_vllm(version, *launch["vllm_args"], "--ipc-stand-in-dir", str(shared), env=launch["vllm_env"])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(
        emu, "--engine", "vllm", "--engine-listen", f"127.0.0.1:{port}", "--refit-source", "tensor"
    )
    model = emu.ok("GET", "/v1/models").body["data"][0]["id"]
    operator = Operator(agent)
    try:
        for step in seq["setup"]:
            check(step, send(url, step, step["body"]))
        texts = []
        for i in (1, 2):
            tensors = make_tensors(str(20 + i), 16 << 10)
            names = sorted(tensors)
            chunks = [
                skyrl_chunk({n: tensors[n] for n in names[:2]}, shared),
                skyrl_chunk({n: tensors[n] for n in names[2:]}, shared),
            ]
            for step in seq["iteration"]:
                body = json.loads(json.dumps(step["body"]).replace('"{{MODEL}}"', json.dumps(model)))
                if "chunk" in step:
                    body["kwargs"]["update_info"] = chunks[step["chunk"]]
                r = send(url, step, body)
                check(step, r)
                if step["path"] == "/v1/completions":
                    texts.append(r.body["choices"][0]["text"])
                assert not operator.errors, operator.errors
            st = agent.state()
            assert st["stage"] == "Serving" and st["engine"]["servedVersion"] == str(i), st
            check_weights(emu, version, tensors)
        assert GARBAGE not in "".join(texts)
        assert texts[0] != texts[1]  # the second rollout ran on the first iteration's weights
    finally:
        operator.stop()
    assert not operator.errors, operator.errors
    calls = json.loads(http("GET", emu.url + "/_emulator/calls").text)
    assert calls["repeats"] == [], calls
    # SkyRL's own lifecycle calls were answered by the endpoint: vLLM saw the agent's.
    assert calls["routes"].get("/sleep") == 2 and calls["routes"].get("/start_weight_update") == 2, calls


def check_weights(emu: VllmEmulator, version: str, tensors: dict[str, Any]) -> None:
    """What vLLM holds is what SkyRL pushed: on 0.34 its /weight_checker hashes are the pushed bytes'."""
    if version != "0.34.0":
        return
    import hashlib

    held = emu.ok("POST", "/weight_checker", {"action": "checksum"}).body["checksums"]
    for name, array in tensors.items():
        assert held[f"dp0:pp0:pcp0:tp0:{name}"] == hashlib.sha256(array.tobytes()).hexdigest(), name


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_the_endpoint_refuses_in_vllms_error_shape(
    version: str, start_vllm: Callable[..., VllmEmulator], start_agent: Callable[..., Agent]
) -> None:
    """Calls that would reach every worker outside the gang's lock-step, or zero its weights, are refused
    with vLLM's error shape (V-ROUTE-ERRORS) and reach vLLM with nothing; generation passes through."""
    emu = start_vllm(version, "--enable-sleep-mode")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(emu, "--engine", "vllm", "--engine-listen", f"127.0.0.1:{port}")
    before = emu.stats()["lifecycle_calls"]
    for path, body in (
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/x"}}),
        ("/update_weight_version", {"new_version": "9"}),
        ("/weight_checker", {"action": "reset"}),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "a", "master_port": 1}}),
        ("/release_kv_cache_memory", None),
    ):
        r = http("POST", url + path, body)
        assert r.status in (400, 409) and r.body["error"]["message"].startswith("rljob: "), (path, r.text)
    assert emu.stats()["lifecycle_calls"] == before
    assert agent.state()["trainer"]["lastRefusal"].startswith("POST /release_kv_cache_memory")
    r = http("POST", url + "/v1/completions", {"prompt": "a b", "max_tokens": 2})
    assert r.status == 200 and r.body["choices"][0]["finish_reason"] == "length", r.text
