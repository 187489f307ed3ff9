"""The agent's own overhead per command, against the SGLang emulator with zero-cost operations.

    python tests/bench/bench_agent_overhead.py [--iterations 200] [--version 0.5.23]
    pytest tests/bench/bench_agent_overhead.py -m bench -s

For each action: `own` = the agent's execution time minus the time it waited on SGLang and the GPU probe
(CommandStatus.seconds - engineSeconds); `e2e` = the operator-side round trip of POST /v1/commands?wait=30
until the outcome is back (HTTP, validation, scheduling, execution, long-poll wake-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_procs import ALL_TAGS, Agent, Emulator, write_weights

ACTIONS = ("drain", "release", "grant", "refit", "resume")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(iterations: int, version: str) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {a: {"own": [], "e2e": [], "engine": []} for a in ACTIONS}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        emu = Emulator(tmp, version, "--weights-bytes", str(1 << 30))
        agent = Agent(tmp, emu.url)
        try:
            agent.wait_stage("Ready")
            epoch = 1
            assert agent.command("resume", epoch).body["state"] == "Succeeded"  # open rollout
            for i in range(1, iterations + 1):
                path = str(write_weights(tmp, str(i), size=4096))
                for action in ACTIONS:
                    fields: dict[str, object] = {}
                    if action == "release":
                        fields = {"tags": ALL_TAGS}
                    elif action == "refit":
                        fields = {"version": str(i), "path": path}
                    epoch += 1
                    started = time.perf_counter()
                    r = agent.command(action, epoch, wait=30, **fields)
                    e2e = time.perf_counter() - started
                    assert r.status == 200 and r.body["state"] == "Succeeded", (action, r.text)
                    samples[action]["e2e"].append(e2e)
                    samples[action]["own"].append(r.body["seconds"] - r.body.get("engineSeconds", 0.0))
                    samples[action]["engine"].append(r.body.get("engineSeconds", 0.0))
                    if action == "grant":
                        pub = agent.trainer("POST", "/v1/trainer/publish", {"version": str(i), "path": path})
                        assert pub.status == 200, pub.text
            assert emu.alive()
        finally:
            agent.stop()
            emu.stop()
    return samples


def table(samples: dict[str, dict[str, list[float]]], iterations: int, version: str) -> str:
    ms = 1000.0
    lines = [
        f"agent overhead per command: SGLang emulator {version}, zero-cost operations, {iterations} cycles",
        f"{'action':<8} {'own p50':>9} {'own p99':>9} {'e2e p50':>9} {'e2e p99':>9} {'engine p50':>11}  (ms)",
    ]
    for action, s in samples.items():
        own, e2e, engine = s["own"], s["e2e"], statistics.median(s["engine"]) * ms
        lines.append(
            f"{action:<8} {_pct(own, 0.5) * ms:9.2f} {_pct(own, 0.99) * ms:9.2f} "
            f"{_pct(e2e, 0.5) * ms:9.2f} {_pct(e2e, 0.99) * ms:9.2f} {engine:11.2f}"
        )
    return "\n".join(lines)


@pytest.mark.bench
def test_agent_overhead(request: pytest.FixtureRequest) -> None:
    if "bench" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("benchmark: run with -m bench")
    print("\n" + table(run(100, "0.5.23"), 100, "0.5.23"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--version", default="0.5.23")
    args = p.parse_args()
    print(table(run(args.iterations, args.version), args.iterations, args.version))


if __name__ == "__main__":
    main()
