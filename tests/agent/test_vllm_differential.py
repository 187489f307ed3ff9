"""The vLLM emulator held to real vLLM, in CI. tests/gpu/test_real_vllm.py sends the sequences of
tests/differential/vllm/sequences.json and tests/replays/vllm to real vLLM 0.26.0 on a GPU, each from the
stated state (vllm_differential.RESET), and writes what it answered as real-0.26.0.json, committed here as
tests/differential/vllm/real-0.26.0.json. Here the same sequences go to the emulator: at 0.26.0 and 0.34.0
each must run from the stated state and leave the server serving (no recording needed); and for every
committed recording the emulator at its version, launched as real vLLM was, must answer as it did, each
difference recorded in tests/differential/vllm/known-differences.json with the docs/vllm-conformance.md
row that says what real vLLM does. RLJOB_VLLM_RECORDINGS names another folder of recordings."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from vllm_procs import VllmEmulator

from rljob.testing import differential, vllm_differential
from rljob.testing.tiny_model import TinyLlama

ROOT = Path(__file__).resolve().parents[2]
DIFFERENTIAL = ROOT / "tests" / "differential" / "vllm"
SEQUENCES = DIFFERENTIAL / "sequences.json"
REPLAYS = ROOT / "tests" / "replays" / "vllm"
KNOWN = DIFFERENTIAL / "known-differences.json"
CONFORMANCE = ROOT / "docs" / "vllm-conformance.md"
RECORDINGS = Path(os.environ.get("RLJOB_VLLM_RECORDINGS") or DIFFERENTIAL)
EMULATOR_TPS = 300  # tokens per second per request: the requests in flight of 1000 tokens run for seconds
PLACEHOLDER = re.compile(r"\{\{([A-Z0-9_]+)\}\}")


def launch_doc() -> dict[str, Any]:
    return dict(json.loads(SEQUENCES.read_text())["launch"])


def sequences() -> list[dict[str, Any]]:
    return vllm_differential.load_sequences(SEQUENCES, REPLAYS)


def run_on_emulator(
    tmp: Path, version: str, flags: list[str], env: dict[str, str], tps: float
) -> list[dict[str, Any]]:
    """Every sequence, each from the stated state, to the emulator at `version` launched with `flags`."""
    launch = TinyLlama().write(tmp / "v0", seed=0)
    emu = VllmEmulator(tmp, version, *flags, sleep_mode=False, tps=tps, model=launch, env=env)
    try:
        emu.wait_ready(60)
        return differential.run_all(
            emu.url,
            emu.alive,
            sequences(),
            version,
            vllm_differential.contexts(tmp / "contexts", launch),
            reset=True,
            engine=vllm_differential.VLLM,
        )
    finally:
        emu.stop()


def test_the_sequences_parse(tmp_path: Path) -> None:
    """Each step is sendable at each version it runs at, every placeholder resolves, every body is JSON."""
    seqs = sequences()
    names = [s["name"] for s in seqs]
    assert len(set(names)) == len(names), names
    assert "replay:skyrl" in names
    launch = TinyLlama().write(tmp_path / "v0", seed=0)
    make = vllm_differential.contexts(tmp_path / "contexts", launch)
    for seq in seqs:
        ctx = make(seq["name"])
        ctx.build_all(seq)
        for version in vllm_differential.VERSIONS:
            labels = []
            for i, step in enumerate(seq["steps"]):
                assert set(step.get("only_versions", [version])) <= set(vllm_differential.VERSIONS), step
                if version not in step.get("only_versions", [version]) or step.get("join"):
                    continue
                assert step["method"] in ("GET", "POST") and step["path"].startswith("/"), step
                text = step["path"] + (step.get("body") or "")
                unknown = set(PLACEHOLDER.findall(text)) - set(ctx.values)
                assert not unknown, f"{seq['name']} step {i}: placeholders no builder resolves: {unknown}"
                if step.get("body") is not None:
                    json.loads(ctx.fill(step["body"]))
                ctx.fill(step["path"])
                labels.append(differential.step_label(i, step))
            assert len(set(labels)) == len(labels), labels


@pytest.mark.parametrize("version", vllm_differential.VERSIONS)
def test_every_sequence_runs_from_the_stated_state(version: str, tmp_path: Path) -> None:
    """Each sequence starts from vllm_differential.RESET (which raises when the server cannot reach it), is
    answered at every step, and leaves the emulator alive and serving: neither paused nor asleep, a
    completion answered, as the next sequence's reset needs."""
    doc = launch_doc()
    observed = run_on_emulator(tmp_path, version, doc["vllm_args"], doc["vllm_env"], EMULATOR_TPS)
    assert [o["name"] for o in observed] == [s["name"] for s in sequences()], "a sequence was not sent"
    for obs in observed:
        unanswered = [st["label"] for st in obs["steps"] if st["status"] == 0]
        assert not unanswered, f"{obs['name']}: no answer to {unanswered}"
        assert obs["alive_after"], f"{obs['name']} ended the emulator"
        state = obs["state_after"]
        assert (state["is_paused"], state["is_sleeping"], state["generate_status"]) == (False, False, 200), (
            f"{obs['name']} left the emulator not serving: {state}"
        )


def recordings() -> list[Path]:
    return sorted(RECORDINGS.glob("real-*.json"))


def test_the_emulator_answers_as_vllm_did(tmp_path: Path) -> None:
    """For each recording of real vLLM: it covers every sequence, and the emulator at its version, launched
    with its flags, answers each sequence as real vLLM did, up to the recorded differences; a recorded
    difference that no longer occurs must go. Without a recording no difference can be recorded."""
    known = differential.recorded(KNOWN)
    if not recordings():
        assert not known, f"{KNOWN.name} records differences from no recording"
    seen = set()
    unrecorded = []
    for path in recordings():
        real = json.loads(path.read_text())
        assert not real.get("stand_in"), (
            f"{path.name} was recorded from the emulator standing in for vLLM "
            f"({real['stand_in']}), not from real vLLM: it holds the emulator to nothing"
        )
        assert [s["name"] for s in real["sequences"]] == [s["name"] for s in sequences()], (
            f"the sequences changed since real vLLM answered {path.name}: run tests/gpu/test_real_vllm.py "
            "on a GPU (docs/real-vllm.md) and commit its real-<version>.json"
        )
        emulated = run_on_emulator(
            tmp_path / real["version"],
            real["version"],
            real["launch_flags"],
            real["env"],
            real["emulator_tps"],
        )
        by_name = {o["name"]: o for o in emulated}
        for r in real["sequences"]:
            e = by_name.get(r["name"])
            diffs = differential.differences(r, e, "vLLM") if e is not None else ["not run on the emulator"]
            for d in diffs:
                key = f"{r['name']}: {d}"
                seen.add(key)
                if key not in known:
                    unrecorded.append(f"{path.name}: {key}")
    assert not unrecorded, "differences from real vLLM that no row records:\n" + "\n".join(unrecorded)
    stale = sorted(set(known) - seen)
    assert not stale, "recorded differences that no longer occur (remove them):\n" + "\n".join(stale)


def test_each_recorded_difference_names_a_vllm_row() -> None:
    rows = CONFORMANCE.read_text()
    named = set(differential.recorded(KNOWN).values())
    missing = {row for row in named if not row.startswith("V-") or f"| {row} |" not in rows}
    assert not missing, f"rows not in docs/vllm-conformance.md: {sorted(missing)}"
