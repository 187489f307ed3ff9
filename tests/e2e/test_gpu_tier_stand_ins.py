"""The GPU tier's own code, run here against its stand-ins: the operator's loop
(tests/gpu/test_operator_loop.py) and the real-vLLM tier (tests/gpu/test_real_vllm.py) each have a switch
that puts the engine emulator where the real engine runs. A GPU run happens seldom and must work the first
time, so what a CPU can find in those files (imports, fixtures, the drive, the checks, the results they
write) is found here, on every change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rljob.testing.harness import ROOT


@pytest.mark.parametrize(
    ("test_file", "switch"),
    [
        ("tests/gpu/test_operator_loop.py", "RLJOB_GPU_LOOP_STAND_IN"),
        ("tests/gpu/test_real_vllm.py", "RLJOB_GPU_VLLM_STAND_IN"),
    ],
)
def test_the_gpu_tier_runs_against_its_stand_in(test_file: str, switch: str, tmp_path: Path) -> None:
    env = {**os.environ, switch: "emulator", "RLJOB_GPU_RESULTS_DIR": str(tmp_path / "results")}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", test_file],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    summary = [line for line in out.splitlines() if " passed" in line][-1:]  # pytest's last line
    assert summary and "skipped" not in summary[0] and "failed" not in summary[0], out[-3000:]
    assert any((tmp_path / "results").rglob("*")), "the stand-in run wrote no results"
