"""The operator's whole loop in front of real SGLang on a GPU: `kubectl apply` an RLJob of one pod, 3
iterations, to Succeeded (operator_loop.py sets up the world: a real control plane, the chart installed with
helm, the operator as the chart's ServiceAccount, a fake kubelet running each container's own command).

One RLJob per refit source (RLJOB_GPU_LOOP_SOURCES, `disk,tensor` by default), one after the other: the source
is the RLJob's (spec.refit.source, immutable), so a trainer publishes every version the same way. Each job:

- ends Succeeded with weight history 0, 1, 2, 3 and SGLang serving version 3 without a restart;
- after the last refit, SGLang's logprobs for fixed prompts equal the trainer's transformers forward of the
  weights it published (test_real_sglang.LOGPROB_TOLERANCE per token, the same greedy token);
- `kubectl rljob status` and `kubectl rljob profile` print the prefix-cache hit rate, tokens/s and GPU busy
  the agent read from SGLang's /metrics and NVML, and each iteration's figures are compared with SGLang's own
  /metrics read by this test at the rollout's two edges (operator_loop.compare: the tolerances and why).

Skipped, with the reason, without a GPU, SGLang 0.5.15.post1 or the control-plane binaries. With
RLJOB_GPU_LOOP_STAND_IN=emulator the emulator and the simulated trainer stand in for SGLang and torch (no
logprob check then): the harness proven on CPU. Figures and logs: $RLJOB_GPU_RESULTS_DIR/operator_loop_*."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_helpers import cuda_missing
from operator_loop import (
    ITERATIONS,
    NAMESPACE,
    SOURCES_ENV,
    Deadline,
    Job,
    Loop,
    compare,
    missing_binaries,
    profile_rows,
    rows_json,
    same_next_token,
    say,
    served_logprobs,
    stand_in,
    status_last,
    table,
)
from real_sglang import sglang_missing
from test_real_sglang import LOGPROB_TOLERANCE

from rljob.testing.gpu_models import spec_from_env

SESSION_STARTED = time.monotonic()
SOURCES = tuple(s for s in os.environ.get(SOURCES_ENV, "disk,tensor").split(",") if s)
JOB_TIMEOUT_S = 480  # a cold start of SGLang at 8B (up to 2 min) and 3 iterations


def why_not() -> str | None:
    missing = missing_binaries()
    if missing:
        return f"control-plane binaries missing (hack/build-binaries.sh, or hack/devloop.sh setup): {missing}"
    if stand_in():
        return None
    return cuda_missing() or sglang_missing()


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(the model's spec, its launch checkpoint): RLJOB_GPU_MODEL (rljob.testing.gpu_models, tiny by
    default), seed 0, written by a process of its own (a model drawn on the GPU leaves nothing held in this
    one)."""
    reason = why_not()
    if reason:
        pytest.skip(f"GPU loop: {reason}")
    spec = spec_from_env()
    launch = tmp_path_factory.mktemp("loop-model") / "v0"
    started = time.monotonic()
    code = "import sys; from rljob.testing.gpu_models import load_model; load_model(sys.argv[1]).write("
    code += "__import__('pathlib').Path(sys.argv[2]), seed=0)"
    subprocess.run([sys.executable, "-c", code, spec, str(launch)], check=True, timeout=600)
    say(f"== the launch checkpoint of {spec}: {launch} ({time.monotonic() - started:.1f} s)")
    return spec, launch


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, loop_model: tuple[str, Path]) -> Iterator[Loop]:
    world = Loop(tmp_path_factory.mktemp("loop"), *loop_model, Deadline(SESSION_STARTED))
    try:
        yield world.start()
    finally:
        world.stop()


@pytest.mark.parametrize("source", SOURCES)
def test_rljob_succeeds_in_front_of_sglang(loop: Loop, source: str, results_dir: Path) -> None:
    job = loop.prepare(source, results_dir)
    try:
        _run(loop, job, results_dir)
    except BaseException:
        say(f"\n== {job.name} failed; the logs' tails:\n{loop.log_tails(job)}")
        raise
    finally:
        loop.save_logs(job, results_dir)
        loop.delete_job(job)


def _run(loop: Loop, job: Job, results_dir: Path) -> None:
    obj = loop.run_job(job, JOB_TIMEOUT_S)
    status = obj["status"]
    assert status["phase"] == "Succeeded", (status.get("reason"), status.get("message"))
    assert [w["version"] for w in status["weightHistory"]] == ["0", "1", "2", "3"], status["weightHistory"]
    assert status["weightVersion"] == "3" and status["iteration"] == ITERATIONS and status["restarts"] == 0
    walls = ", ".join(f"{r['wallSeconds']:.2f} s" for r in status["iterationHistory"])
    say(f"== {job.name}: Succeeded {job.phases_seconds:.1f} s after kubectl apply; first rollout after "
        f"{job.serving_after:.1f} s (the pod's start, SGLang's launch); iterations {walls}")  # fmt: skip
    pod = loop.pod(job.name)
    sglang = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "sglang")
    assert "running" in sglang["state"] and sglang["restartCount"] == 0, sglang
    url = f"http://{pod['status']['podIP']}:30000"
    report: dict[str, object] = {
        "job": job.name,
        "source": job.source,
        "seconds": round(job.phases_seconds, 1),
    }

    # After the last refit: SGLang's logprobs = the trainer's forward of the weights it published.
    if loop.stand_in:
        say("\n== STAND-IN: no model behind the emulator, so no logprob check")
    else:
        reference = json.loads((job.claim / f"reference-v{ITERATIONS}.json").read_text())
        checked = served_logprobs(url, reference)
        report["logprobs"] = checked
        say(f"\n== logprobs after the last refit (tolerance {LOGPROB_TOLERANCE} nats per token):")
        for name, c in checked.items():
            say(f"   {name}: max |d| {c['max_abs_diff']:.4f}, next token {c['next_token']} "
                f"(the trainer's {c['ref_next_token']}), weight_version {c['weight_version']}")  # fmt: skip
        for name, c in checked.items():
            assert c["weight_version"] == str(ITERATIONS), (name, c)
            assert c["max_abs_diff"] <= LOGPROB_TOLERANCE, (name, c)
            assert same_next_token(c["next_token"], reference[name], LOGPROB_TOLERANCE), (
                name,
                c,
                reference[name],
            )

    # Where a user looks: kubectl rljob status / profile.
    shown_status = loop.kubectl_user("rljob", "-n", NAMESPACE, "status", job.name)
    say(f"\n$ kubectl rljob status {job.name}\n{shown_status}")
    html = results_dir / f"operator_loop_{job.name}_profile.html"
    shown_profile = loop.kubectl_user("rljob", "-n", NAMESPACE, "profile", job.name, "--html", str(html))
    say(f"$ kubectl rljob profile {job.name} --html {html.name}\n{shown_profile}")
    printed = profile_rows(shown_profile)
    last = status["lastIteration"]
    assert status_last(shown_status) == {
        "cache_hit": f"{last['cacheHitRate']:.0%}",
        "tokens_per_second": f"{last['generationTokensPerSecond']:.0f}",
        "gpu_busy": f"{last['gpuBusyFraction']:.0%}",
    }, (status_last(shown_status), last)
    assert printed[ITERATIONS] == status_last(shown_status), (printed, status_last(shown_status))

    # Each iteration's figures against SGLang's own /metrics over the same rollout.
    rows = compare(job, status, printed)
    text = table(rows)
    say(f"== {job.name}: the agent's figures against SGLang's own /metrics at each rollout's edges\n{text}")
    report["comparison"] = rows_json(rows)
    report["edges"] = {f"{i}-{e}": sums for (i, e), (_t, sums) in job.edges.seen.items()}
    (results_dir / f"operator_loop_{job.name}.json").write_text(json.dumps(report, indent=1))
    (results_dir / f"operator_loop_{job.name}.md").write_text(f"{shown_status}\n{shown_profile}\n{text}\n")
    bad = [r for r in rows if not r.ok]
    assert not bad, f"figures outside their tolerance:\n{table(bad)}"
