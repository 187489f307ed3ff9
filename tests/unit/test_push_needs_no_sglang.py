"""The tensor push imports nothing at push time: SGLang's serializer took 2.2 to 8.3 s to import in a
trainer (tests/gpu/RESULTS.md), which a trainer that pushes right after its lease paid inside the refit.
The SDK writes the payload itself, so a bucket is packed and serialized without any import of sglang."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from rljob.trainer.engines.sglang import packing

torch = pytest.importorskip("torch")


class SGLangImports(importlib.abc.MetaPathFinder):
    """Records every attempt to import sglang (and refuses it, as a trainer without sglang would)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname.split(".")[0] == "sglang":
            self.asked.append(fullname)
            raise ImportError(f"no {fullname} in this trainer")
        return None


@pytest.fixture
def sglang_imports(monkeypatch: pytest.MonkeyPatch) -> SGLangImports:
    finder = SGLangImports()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    return finder


def test_packing_and_serializing_a_bucket_imports_no_sglang(
    sglang_imports: SGLangImports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket of meta tensors (no CUDA here) through pack_and_serialize: the payload is written and no
    import of sglang was even attempted."""
    nothing_to_wait = SimpleNamespace(synchronize=lambda: None)  # meta tensors: no stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: nothing_to_wait)
    named = [
        ("w", torch.empty(4, 8, dtype=torch.bfloat16, device="meta")),
        ("v", torch.empty(8, dtype=torch.bfloat16, device="meta")),
    ]
    specs = [packing.TensorSpec(n, "bfloat16", tuple(t.shape), t.numel() * 2, "meta") for n, t in named]
    (plan,) = packing.plan_buckets(specs, 1 << 20)
    report = packing.PushReport()
    bucket = packing.pack_and_serialize(named, plan, packing.BucketBuffers(), 1 << 20, 1, report)
    assert len(bucket.payloads) == 1 and report.order == ["w", "v"] and report.bytes == 80
    assert sglang_imports.asked == []
