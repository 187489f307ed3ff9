"""The replies SGLang's framework endpoint gives itself (agent/engines/sglang/endpoint.py) are those of
the pod's SGLang version, as its client read it: a row of REPLIES by the oldest version it holds for."""

from __future__ import annotations

import dataclasses

import pytest

from rljob.agent.engines.sglang import endpoint
from rljob.agent.engines.sglang.quirks import SGLangQuirks


def test_every_version_checked_gets_the_one_row() -> None:
    rows = [endpoint.replies_for(SGLangQuirks.detect(v)) for v in ("0.5.6", "0.5.15.post1", "0.5.23")]
    assert rows == [endpoint.Replies()] * 3
    assert endpoint.replies_for(None) == endpoint.Replies()


def test_a_row_for_a_newer_version_is_taken_from_that_version_on(monkeypatch: pytest.MonkeyPatch) -> None:
    newer = dataclasses.replace(endpoint.Replies(), flushed="Cache flushed.\n")
    monkeypatch.setattr(endpoint, "REPLIES", (((0, 5, 6), endpoint.Replies()), ((0, 5, 30), newer)))
    assert endpoint.replies_for(SGLangQuirks.detect("0.5.23")) == endpoint.Replies()
    assert endpoint.replies_for(SGLangQuirks.detect("0.5.30")) == newer
    assert endpoint.replies_for(SGLangQuirks.detect("0.6.0")) == newer
    assert endpoint.replies_for(None) == newer  # the version not read yet: the newest
