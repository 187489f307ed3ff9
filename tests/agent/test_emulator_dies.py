"""The emulator dies exactly where SGLang dies (C-DEATH-EXC, C-IDLE-RELEASE, C-MEM-*, C-REFIT-FLUSH-FAIL in
docs/sglang-conformance.md): called directly, bypassing the agent. Each test proves the process exits
non-zero and logs SGLang's text. Where SGLang survives or hangs instead, see test_emulator_conformance.py."""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import VERSIONS, Emulator, wait_until, write_weights
from test_emulator_conformance import local_serialized_push
from test_refit_window import bucket_without_numel

from rljob.emulator.rendezvous import Rank0
from rljob.trainer.engines.sglang import packing

pytestmark = pytest.mark.emulator_may_die


def _dies(emu: Emulator, text: str) -> None:
    code = emu.wait_exit(10)
    assert code != 0, f"exit code {code}"
    assert text in emu.log_text(), emu.log_text()[-2000:]


def _call_expecting_drop(emu: Emulator, path: str, body: object) -> None:
    try:
        r = emu.call("POST", path, body, timeout=10)
    except OSError:  # connection dropped: what the client of a dead SGLang sees
        return
    raise AssertionError(f"{path} answered {r.status} {r.text}; SGLang would have died")


def _start_long_request(emu: Emulator) -> threading.Thread:
    def run() -> None:
        body = {"text": "a b c", "sampling_params": {"max_new_tokens": 500}}
        with contextlib.suppress(OSError):  # the server may die under it: that is the point
            emu.call("POST", "/generate", body, timeout=30)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: emu.stats()["running"] == 1, 5, "the request to run")
    return t


@pytest.mark.parametrize("version", VERSIONS)
def test_release_while_a_request_runs(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version, tps=50)
    _start_long_request(emu)
    _call_expecting_drop(emu, "/release_memory_occupation", {"tags": ["kv_cache"]})
    expected = "no ongoing request" if version == "0.5.6" else "only when server is idle"
    _dies(emu, expected)
    assert "Scheduler hit an exception" in emu.log_text()


@pytest.mark.parametrize("version", VERSIONS)
def test_release_after_in_place_pause_with_running_request(
    version: str, start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator(version, tps=50)
    _start_long_request(emu)
    assert emu.call("POST", "/pause_generation", {"mode": "in_place"}).status == 200
    _call_expecting_drop(emu, "/release_memory_occupation", {})
    _dies(emu, "release_memory_occupation should be called only when")


@pytest.mark.parametrize("version", [v for v in VERSIONS if v != "0.5.6"])
def test_double_release(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-MEM-DOUBLE-RELEASE: TMS exit(1), and the watchdog (≥0.5.10) takes the server down; 0.5.6 hangs
    instead (test_emulator_conformance.py)."""
    emu = start_emulator(version)
    assert emu.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    _call_expecting_drop(emu, "/release_memory_occupation", {"tags": ["kv_cache"]})
    _dies(emu, "Cannot pause allocation that is not active")


@pytest.mark.parametrize("version", VERSIONS)
def test_resume_of_an_unreleased_tag(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version)
    assert emu.call("POST", "/release_memory_occupation", {"tags": ["weights"]}).status == 200
    _call_expecting_drop(emu, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    _dies(emu, "KeyError: 'kv_cache'")


@pytest.mark.parametrize("version", ["0.5.20", "0.5.21", "0.5.23"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/release_memory_occupation", {"tags": ["weights"]}),
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}),
    ],
)
def test_weights_operation_under_weight_cache(
    version: str, path: str, body: dict[str, object], start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator(version, "--weight-cache-mode", "client")
    if "distributed" in path:
        with Rank0(0, world_size=2) as rank0:  # the trainer's side of the group (C-REFIT-GROUP-BLOCK)
            joined = threading.Thread(target=rank0.wait, args=(10,))
            joined.start()
            group = {"master_address": "127.0.0.1", "master_port": rank0.port, "rank_offset": 1}
            assert emu.call("POST", "/init_weights_update_group", {**group, "world_size": 2}).status == 200
            joined.join()
        emu.call("POST", "/begin_weight_update", {})
    _call_expecting_drop(emu, path, body)
    _dies(emu, "[weight_cache]")
    assert "--weight-cache-mode client" in emu.log_text()


@pytest.mark.parametrize("version", ["0.5.6", "0.5.15.post1", "0.5.20"])
def test_distributed_push_naming_no_group(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-REFIT-GROUP-UNKNOWN: the assert sits outside any try up to 0.5.20 (0.5.21+ answers 400)."""
    emu = start_emulator(version)
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "never_formed"}
    _call_expecting_drop(emu, "/update_weights_from_distributed", body)
    _dies(emu, "Please call `init_weights_update_group` first.")


def test_tensor_push_that_is_not_base64(start_emulator: Callable[..., Emulator]) -> None:
    """C-REFIT-TENSOR-B64: 0.5.6 decodes in the scheduler with no try."""
    emu = start_emulator("0.5.6")
    body = {"serialized_named_tensors": ["not base64!"], "flush_cache": False}
    _call_expecting_drop(emu, "/update_weights_from_tensor", body)
    _dies(emu, "binascii.Error")


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_push_that_is_not_a_pickle(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-REFIT-TENSOR-PICKLE: each rank's payload goes through SafeUnpickler(...).load() in the scheduler,
    outside any try: bytes that are not a pickle raise UnpicklingError, fatal on every version."""
    emu = start_emulator(version)
    emu.call("POST", "/begin_weight_update", {})  # 404 before 0.5.21
    body = {"serialized_named_tensors": [base64.b64encode(b"xyz").decode()], "flush_cache": False}
    _call_expecting_drop(emu, "/update_weights_from_tensor", body)
    _dies(emu, "UnpicklingError: invalid load key, 'x'.")


@pytest.mark.parametrize(
    ("version", "error"), [("0.5.6", "CVE-2025-10164"), ("0.5.23", "Can't get attribute")]
)
def test_local_serialized_tensor_at_a_path_the_version_lacks(
    version: str, error: str, start_emulator: Callable[..., Emulator]
) -> None:
    """C-REFIT-TENSOR-LOCAL: LocalSerializedTensor pickled at the other version's module path: 0.5.6's
    prefix allowlist blocks model_runner_components; 0.5.23 allows model_runner's name but that module no
    longer has the class (find_class raises AttributeError). Both in the scheduler: fatal."""
    emu = start_emulator(version)
    emu.call("POST", "/begin_weight_update", {})
    other = "0.5.23" if version == "0.5.6" else "0.5.6"
    body = {"serialized_named_tensors": [local_serialized_push(other)], "flush_cache": False}
    _call_expecting_drop(emu, "/update_weights_from_tensor", body)
    _dies(emu, error)


@pytest.mark.parametrize("version", VERSIONS)
def test_bucket_metadata_without_numel(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-REFIT-TENSOR-META: each entry's numel is read into SGLang's own FlattenedTensorMetadata in the
    scheduler, outside any try, at every version."""
    emu = start_emulator(version)
    emu.call("POST", "/begin_weight_update", {})  # 404 before 0.5.21
    body = {
        "serialized_named_tensors": [packing.to_wire(bucket_without_numel())],
        "load_format": "flattened_bucket",
        "flush_cache": False,
    }
    _call_expecting_drop(emu, "/update_weights_from_tensor", body)
    _dies(emu, "numel")


@pytest.mark.parametrize("version", VERSIONS)
def test_generate_reaching_released_memory(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """Release does not pause: a request arriving while KV is unmapped touches unmapped memory."""
    emu = start_emulator(version)
    assert emu.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    _call_expecting_drop(emu, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    _dies(emu, "illegal memory access")


@pytest.mark.parametrize("version", VERSIONS)
def test_refit_into_released_weights(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator(version)
    assert emu.call("POST", "/release_memory_occupation", {"tags": ["weights"]}).status == 200
    _call_expecting_drop(emu, "/update_weights_from_disk", {"model_path": str(write_weights(tmp_path, "1"))})
    _dies(emu, "illegal memory access")


@pytest.mark.parametrize("version", VERSIONS)
def test_post_refit_flush_with_running_requests(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator]
) -> None:
    """≤0.5.21 asserts "Cache flush failed after updating weights" (sglang#12099); 0.5.23: success:false."""
    emu = start_emulator(version, tps=50)
    _start_long_request(emu)
    assert emu.call("POST", "/pause_generation", {"mode": "in_place"}).status == 200
    body = {"model_path": str(write_weights(tmp_path, "1")), "weight_version": "1"}
    if version == "0.5.23":
        r = emu.call("POST", "/update_weights_from_disk", body)
        assert r.status == 400 and r.body["success"] is False and "not flushed" in r.body["message"]
        assert emu.alive()
        assert emu.call("GET", "/model_info").body["weight_version"] == "default"  # version not recorded
        return
    _call_expecting_drop(emu, "/update_weights_from_disk", body)
    _dies(emu, "Cache flush failed after updating weights")


@pytest.mark.parametrize("version", VERSIONS)
def test_an_input_id_past_the_vocabulary(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-GEN-VOCAB: seen on real SGLang 0.5.15.post1 (an H100, TinyLlama of 2048 tokens, slime's id 9707)."""
    from rljob.emulator import tokens

    emu = start_emulator(version)
    _call_expecting_drop(emu, "/generate", {"input_ids": [5, tokens.VOCAB], "sampling_params": {}})
    _dies(emu, "device-side assert triggered")
