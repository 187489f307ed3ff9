"""The emulator held to real SGLang, in CI. tests/gpu/test_real_sglang.py sent the sequences of
tests/differential/sequences.json and tests/replays to real SGLang 0.5.15.post1 on a GPU and recorded what
it answered (tests/differential/real-0.5.15.post1.json, with the launch flags and the emulator's speed of
that run; a recording with `launches` holds, per other launch, the replays whose client launches SGLang
so; one with `reset` sent each sequence from differential.RESET's state). Here the same sequences go to
the emulator at that version, launched the same ways, the same way. Every difference must be recorded in
tests/differential/known-differences.json with the docs/sglang-conformance.md row that says what real
SGLang does; a recorded difference that no longer occurs must go too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Emulator

from rljob.testing import differential
from rljob.testing.tiny_model import TinyLlama

ROOT = Path(__file__).resolve().parents[2]
DIFFERENTIAL = ROOT / "tests" / "differential"
RECORDING = DIFFERENTIAL / "real-0.5.15.post1.json"
KNOWN = DIFFERENTIAL / "known-differences.json"
CONFORMANCE = ROOT / "docs" / "sglang-conformance.md"


@pytest.fixture(scope="module")
def real() -> dict[str, Any]:
    return dict(json.loads(RECORDING.read_text()))


def launches(real: dict[str, Any]) -> list[tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]]:
    """Per launch of the recording: (its flags, the sequences it takes now, the recorded answers)."""
    out = []
    for flags, recorded, own in [
        (real["launch_flags"], real["sequences"], True),
        *((v["launch_flags"], v["sequences"], False) for v in real.get("launches", {}).values()),
    ]:
        sequences, _ = differential.load_sequences(
            DIFFERENTIAL / "sequences.json", ROOT / "tests" / "replays", flags, own_sequences=own
        )
        out.append((list(flags), sequences, list(recorded)))
    return out


@pytest.fixture(scope="module")
def emulated(real: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The recorded run's sequences, in its order, to the emulator launched as real SGLang was."""
    tmp = tmp_path_factory.mktemp("differential")
    launch = TinyLlama().write(tmp / "v0", seed=0)
    out: list[dict[str, Any]] = []
    for k, (flags, sequences, _) in enumerate(launches(real)):
        emu = Emulator(
            tmp,
            real["version"],
            *flags,
            "--model-path",
            str(launch),
            memory_saver=False,
            tps=real["emulator_tps"],
        )
        try:
            emu.wait_ready(60)
            out += differential.run_all(
                emu.url,
                emu.alive,
                sequences,
                real["version"],
                differential.contexts(tmp / f"launch-{k}", launch),
                reset=bool(real.get("reset")),
            )
        finally:
            emu.stop()
    return out


def test_the_recording_covers_every_sequence(real: dict[str, Any]) -> None:
    _, left_out = differential.load_sequences(
        DIFFERENTIAL / "sequences.json", ROOT / "tests" / "replays", real["launch_flags"]
    )
    for _, sequences, recorded in launches(real):
        assert [s["name"] for s in recorded] == [s["name"] for s in sequences], (
            "the sequences changed since real SGLang answered them: run tests/gpu/test_real_sglang.py "
            "(hack/devgpu.sh) and commit its real-<version>.json"
        )
        # the fatal sequence ended real SGLang; every other one left it serving
        assert [s["alive_after"] for s in recorded] == [not s.get("fatal") for s in sequences]
    assert real["left_out"] == left_out


def test_the_emulator_answers_as_sglang_did(real: dict[str, Any], emulated: list[dict[str, Any]]) -> None:
    known = differential.recorded(KNOWN)
    by_name = {o["name"]: o for o in emulated}
    seen = set()
    unrecorded = []
    for r in [r for _, _, recorded in launches(real) for r in recorded]:
        e = by_name.get(r["name"])
        diffs = differential.differences(r, e) if e is not None else ["not run on the emulator"]
        for d in diffs:
            key = f"{r['name']}: {d}"
            seen.add(key)
            if key not in known:
                unrecorded.append(key)
    assert not unrecorded, "differences from real SGLang that no row records:\n" + "\n".join(unrecorded)
    stale = sorted(set(known) - seen)
    assert not stale, "recorded differences that no longer occur (remove them):\n" + "\n".join(stale)


def test_each_recorded_difference_names_a_conformance_row() -> None:
    rows = CONFORMANCE.read_text()
    missing = {row for row in differential.recorded(KNOWN).values() if f"| {row} |" not in rows}
    assert not missing, f"rows not in docs/sglang-conformance.md: {sorted(missing)}"
