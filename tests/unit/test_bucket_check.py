"""The agent's read of a flattened-bucket push (agent/engines/sglang/bucket_check.py): what SGLang would
miss, named; nothing in the pickle runs."""

from __future__ import annotations

import os
import pickle

from rljob.agent.engines.sglang.bucket_check import missing_in, missing_metadata, read, unreadable
from rljob.trainer.engines.sglang import packing

IPC = packing.Call(packing.Global("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), (1, 2))


def test_an_sdk_bucket_misses_nothing() -> None:
    entries = [
        packing.metadata_entry("a", (2,), "float32", 0, 8),
        packing.metadata_entry("b", (4,), "bfloat16", 8, 16),
    ]
    assert missing_metadata(packing.bucket_payload(IPC, entries)) is None


def test_each_field_sglang_reads_is_named_when_missing() -> None:
    full = packing.metadata_entry("b", (2,), "float32", 8, 16)
    for field in ("name", "shape", "dtype", "start_idx", "end_idx", "numel"):
        bare = packing.Instance(full.cls, {k: v for k, v in full.state.items() if k != field})
        payload = packing.bucket_payload(IPC, [full, bare])
        assert missing_metadata(payload) == f"metadata[1].{field}"


def test_nothing_in_the_pickle_runs(tmp_path: object) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("touch /tmp/rljob-bucket-check-ran",))

    payload = pickle.dumps({"flattened_tensor": Boom(), "metadata": [Boom()]})
    assert missing_metadata(payload) == "metadata[0].name"
    assert not os.path.exists("/tmp/rljob-bucket-check-ran")


def test_what_is_not_a_bucket_is_left_to_sglang() -> None:
    assert missing_metadata(b"opaque bytes") is None
    assert missing_metadata(pickle.dumps([("w", 1)])) is None  # the "direct" format


def test_bytes_sglang_cannot_unpickle_are_named_and_sdk_payloads_are_not() -> None:
    """C-REFIT-TENSOR-PICKLE: empty bytes (EOFError) and bytes that are no pickle kill SGLang's scheduler."""
    assert unreadable(b"") is not None and unreadable(b"").startswith("EOFError")
    assert unreadable(b"\xde\xad\xbe\xef") is not None
    assert unreadable(pickle.dumps({"metadata": []})[:-3]) is not None  # cut short
    entries = [packing.metadata_entry("a", (2,), "float32", 0, 8)]
    assert unreadable(packing.bucket_payload(IPC, entries)) is None
    assert unreadable(pickle.dumps([("w", {"any": 1})])) is None


def test_a_bucket_is_read_once_with_one_stand_in_class_per_global() -> None:
    """A 2 GiB bucket of an 8B model names ~40 entries: the read builds one class per global (creating
    one per entry cost the agent 2.7 ms a push, two reads, on a 2-core CPU), and the metadata check works
    on the object read."""
    entries = [packing.metadata_entry(n, (2,), "float32", 8 * i, 8 * i + 8) for i, n in enumerate("abc")]
    obj, broken = read(packing.bucket_payload(IPC, entries))
    assert broken is None and missing_in(obj) is None
    assert len({type(m) for m in obj["metadata"]}) == 1
    assert len({type(m.shape) for m in obj["metadata"]}) == 1
