"""The tensor push's codec (SGLang's serializer: 2.24 s to import in a real trainer) is resolved while a
torch trainer trains, not inside its first refit window."""

from __future__ import annotations

import functools
import sys
import threading
import types

import pytest

from rljob.trainer import handoff, packing


@pytest.fixture
def warm_up(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], threading.Event]:
    """packing.warm_codec replaced: the names of the threads it ran in, and an event set when it ran."""
    calls: list[str] = []
    ran = threading.Event()

    def warm() -> None:
        calls.append(threading.current_thread().name)
        ran.set()

    monkeypatch.setattr(packing, "warm_codec", warm)
    return calls, ran


def test_a_torch_trainer_warms_the_codec_in_the_background(
    warm_up: tuple[list[str], threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    handoff._warm_tensor_codec()
    assert warm_up[1].wait(5)
    assert warm_up[0] == ["rljob-codec-warm-up"]


def test_a_trainer_without_torch_imports_nothing(
    warm_up: tuple[list[str], threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    handoff._warm_tensor_codec()
    assert not warm_up[1].wait(0.2)
    assert warm_up[0] == []


def test_the_codec_is_resolved_once_when_two_threads_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    resolved: list[int] = []
    inside = threading.Event()
    release = threading.Event()

    def slow_resolve() -> None:
        resolved.append(1)
        inside.set()
        release.wait(5)

    packing._resolve_sglang_codec.cache_clear()
    monkeypatch.setattr(packing, "_resolve_sglang_codec", functools.cache(slow_resolve))
    first = threading.Thread(target=packing._sglang_codec)
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=packing._sglang_codec)
    second.start()
    second.join(0.2)
    assert second.is_alive(), "the second caller did not wait for the first resolution"
    release.set()
    first.join(5)
    second.join(5)
    assert resolved == [1]
