"""The replies the engine endpoint gives itself (agent/engine_api.py) are those of the pod's SGLang version,
as its SGLang client read it: a row of REPLIES by the oldest version it holds for."""

from __future__ import annotations

import dataclasses

import pytest

from rljob.agent import engine_api
from rljob.agent.quirks import SGLangQuirks


def test_every_version_checked_gets_the_one_row() -> None:
    rows = [engine_api.replies_for(SGLangQuirks.detect(v)) for v in ("0.5.6", "0.5.15.post1", "0.5.23")]
    assert rows == [engine_api.Replies()] * 3
    assert engine_api.replies_for(None) == engine_api.Replies()


def test_a_row_for_a_newer_version_is_taken_from_that_version_on(monkeypatch: pytest.MonkeyPatch) -> None:
    newer = dataclasses.replace(engine_api.Replies(), flushed="Cache flushed.\n")
    monkeypatch.setattr(engine_api, "REPLIES", (((0, 5, 6), engine_api.Replies()), ((0, 5, 30), newer)))
    assert engine_api.replies_for(SGLangQuirks.detect("0.5.23")) == engine_api.Replies()
    assert engine_api.replies_for(SGLangQuirks.detect("0.5.30")) == newer
    assert engine_api.replies_for(SGLangQuirks.detect("0.6.0")) == newer
    assert engine_api.replies_for(None) == newer  # the version not read yet: the newest
