"""`kubectl rljob status` rendering, from a status the lifecycle machine produced; and the plugin's one
call, made through rljob.kubeclient without loading the operator."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from lifecycle_world import World, make_spec

from rljob.api.agent import AgentState, RolloutReport, Stage
from rljob.api.spec import ProfileHints
from rljob.api.status import LeverName, Phase, RLJobStatus, Signal, Unmeasured, UnmeasuredReason
from rljob.cli.kubectl_plugin import render
from rljob.cli.profile_report import html_report, terminal_chart
from rljob.lifecycle.clock import parse
from rljob.lifecycle.profile import record_iteration
from rljob.lifecycle.timeline import close_span, open_span, record_rollout_sample


def test_status_shows_timeline_pods_versions_and_verdict() -> None:
    world = World(make_spec(iterations=2))
    world.bring_up()
    world.run_iteration("1")
    world.run_iteration("2", held={"job-0": 12.5, "job-1": 17.25})
    text = render("job", "ns", world.status, {"iterations": 2})
    assert "Phase:      Succeeded (Completed)" in text
    assert "Iteration:  2 of 2" in text
    assert "Weights:    2" in text
    assert "Releasing" in text and "Refitting" in text  # the timeline
    assert "job-0" in text and "job-1" in text  # per-pod rows
    assert "Profile: TrainBound" in text
    assert "Weight history: 0 -> 1 -> 2" in text
    assert "CONTROL-OVERHEAD" in text
    # Training's row: the slowest pod's lease as its agent timed it, beside the span's wall time.
    training = [line.split() for line in text.splitlines() if line.split()[:2] == ["2", "Training"]]
    header = next(line.split() for line in text.splitlines() if line.startswith("ITER"))
    assert training and training[0][header.index("TRAINER")] == "17.25s", training


def test_status_and_profile_name_the_engine_the_pods_report() -> None:
    world = World(make_spec(iterations=1))
    world.bring_up()
    world.run_iteration("1")
    assert "Engine:     SGLang (pods report SGLang 0.5.23)" in render("job", "ns", world.status, {})
    pods = [p.model_copy(update={"engine": "vLLM 0.26.0"}) for p in world.status.pods]
    on_vllm = world.status.model_copy(update={"pods": pods})
    assert "Engine:     vLLM (pods report vLLM 0.26.0)" in render("job", "ns", on_vllm, {"engine": "vllm"})
    assert "Per-iteration profile (1 iterations on vLLM 0.26.0)" in terminal_chart(on_vllm)
    assert "engine vLLM 0.26.0" in html_report("job", "ns", on_vllm)


def _at(stamp: str) -> datetime:
    when = parse(stamp)
    assert when is not None
    return when


def test_status_of_a_job_without_metrics_says_what_was_not_measured() -> None:
    """Two agents whose SGLang ran without --enable-metrics (as agent/rollout.py reports it), through the
    operator's aggregation (timeline, profile, levers) into `kubectl rljob status`."""
    metrics_signals = [Signal.CACHE_HIT_RATE, Signal.GENERATION_TOKENS_PER_SECOND, Signal.TOKEN_COUNTS]
    off = [
        Unmeasured(
            signal=s, reason=UnmeasuredReason.METRICS_DISABLED, message="SGLang runs without --enable-metrics"
        )
        for s in metrics_signals
    ]
    rollout = RolloutReport(
        samples=4,
        window_seconds=6.0,
        gpus=1,
        gpu_busy_fraction=0.3,
        mean_running_requests=4.0,
        mean_waiting_requests=0.0,
        completed_samples=8,
        unmeasured=off,
    )
    agents = [AgentState(revision=1, boot_id=f"b{i}", stage=Stage.DRAINED, rollout=rollout) for i in (0, 1)]
    status = RLJobStatus(phase=Phase.TRAINING, iteration=1)
    open_span(status.timeline, Phase.ROLLOUT, 1, "2024-01-01T00:00:00Z")
    span = close_span(status.timeline, Phase.ROLLOUT, _at("2024-01-01T00:00:06Z"))
    assert span is not None
    record_rollout_sample(status.timeline, span, 1, agents)
    open_span(status.timeline, Phase.TRAINING, 1, "2024-01-01T00:00:06Z")
    close_span(status.timeline, Phase.TRAINING, _at("2024-01-01T00:00:08Z"))
    report = record_iteration(status, ProfileHints(model_bytes=16 << 30))
    assert report.cache_hit_rate is None and report.generation_tokens_per_second is None
    assert [u.signal for u in report.unmeasured] == metrics_signals
    assert [lv.lever for lv in status.diagnosis] == [LeverName.ROLLOUT_CONCURRENCY, LeverName.MEASUREMENT]
    text = render("job", "ns", status, {})
    assert "prefix-cache hit rate not measured, generation not measured" in text
    assert (
        "Not measured: prefix-cache hit rate, generation tokens/s, token counts (MetricsDisabled: SGLang"
        in text
    )
    assert "--enable-metrics" in text and "hit rate 0%" not in text


class StandInApiServer(BaseHTTPRequestHandler):
    """Answers GET of one RLJob (`ANSWER`) and records each request's path and Authorization header."""

    ANSWER = {"metadata": {"name": "job"}, "spec": {"iterations": 3}, "status": {"phase": "Rollout"}}
    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization", "")))
        found = self.path == "/apis/rljob.io/v1alpha1/namespaces/ops/rljobs/job"
        body = json.dumps(self.ANSWER if found else {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def api_server_url() -> Iterator[str]:
    StandInApiServer.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


PLUGIN_RUN = """if True:
    import json, sys
    from rljob.cli.kubectl_plugin import main
    code = main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.startswith(("prometheus_client", "rljob.")))
    print(json.dumps({"code": code, "loaded": loaded}), file=sys.stderr)
"""


def test_the_plugin_reads_an_rljob_through_kubeclient_without_loading_the_operator(
    api_server_url: str, tmp_path: Path
) -> None:
    """`kubectl rljob status` in a fresh interpreter against a stand-in API server: the RLJob read with the
    kubeconfig's credentials and printed, and neither rljob.controller nor prometheus_client loaded."""
    config = {
        "current-context": "k",
        "contexts": [{"name": "k", "context": {"cluster": "c", "user": "u", "namespace": "ops"}}],
        "clusters": [{"name": "c", "cluster": {"server": api_server_url}}],
        "users": [{"name": "u", "user": {"token": "tok-1"}}],
    }
    (tmp_path / "config").write_text(json.dumps(config))
    argv = ["--kubeconfig", str(tmp_path / "config"), "status", "job"]
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN_RUN, *argv], capture_output=True, text=True, timeout=120
    )
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr
    assert "RLJob ops/job" in done.stdout and "Iteration:  0 of 3" in done.stdout, done.stdout
    assert StandInApiServer.seen == [("/apis/rljob.io/v1alpha1/namespaces/ops/rljobs/job", "Bearer tok-1")]
    assert "rljob.kubeclient.apiserver" in result["loaded"]
    operator = [m for m in result["loaded"] if m.startswith("rljob.controller") or m.startswith("prometheus")]
    assert operator == []
