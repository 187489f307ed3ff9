"""The lifecycle decision's CPU at a lock-step phase's end, by gang size: the pure function
(`rljob.lifecycle.machine.decide`) that reads every pod's report, finds the phase done, and addresses the
next phase's command to every pod. The conductor makes this decision after the last report of a phase and
before the next command goes out, so its time is part of every phase's control overhead
(docs/benchmarks.md); at a gang's scale it is what grows with the pods.

    .venv/bin/python tests/bench/bench_decide.py [--sizes 64,512,1024] [--repeat 30]
        [--against DIR]

What runs: the unit tests' world model (tests/unit/lifecycle_world.py: pods, agents and trainers as plain
data) brings an RLJob of N pods to its first rollout, then to the end of Draining (every pod's drain
finished: the decision sends the release) and on to the end of Refitting (it sends the resume). At each
end the same decision is timed `--repeat` times (time.perf_counter around `decide`; the world does not
move between repeats); p50 and min per size. An RLJob holds at most 1,024 pods (spec.replicas).
`--against DIR` times DIR/operator's `decide` in a subprocess of its own, on the same world (this tree's
model), and prints both and their ratio: a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from lifecycle_world import World, make_spec  # noqa: E402

from rljob.api.status import Phase  # noqa: E402
from rljob.lifecycle.machine import decide  # noqa: E402

ENDS = ("Draining", "Refitting")  # phases whose end is timed: each opens a command phase


def _at_end(world: World, phase: Phase) -> None:
    """Moves `world` until every pod finished `phase`'s command (the next decision ends the phase)."""
    while world.status.phase != phase:
        if world.status.phase == Phase.ROLLOUT:
            world.trainers_request()
            world.tick(10)
        elif world.status.phase == Phase.TRAINING:
            world.tick()
            world.finish_all()  # the grant
            world.tick(20)
            world.trainers_publish(str(int(world.status.weight_version or "0") + 1))
        else:
            world.tick()
            world.finish_all()
        world.step()
    world.tick()
    world.finish_all()


def measure(pods: int, repeat: int) -> dict[str, list[float]]:
    world = World(make_spec(replicas=pods, iterations=5))
    world.bring_up()
    out: dict[str, list[float]] = {}
    for name in ENDS:
        _at_end(world, Phase(name))
        obs = world.observe()
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            decision = decide(world.spec, world.status, obs)
            times.append(time.perf_counter() - began)
        assert decision.status.phase != Phase(name) and len(decision.commands) == pods, decision.status.phase
        out[name] = times
        world.apply(decision)
    return out


def table(sizes: list[int], repeat: int, against: Path | None = None) -> str:
    mine = {n: measure(n, repeat) for n in sizes}
    other = None
    if against is not None:
        env = {**os.environ, "PYTHONPATH": str(against / "operator")}
        sizes_arg = ",".join(map(str, sizes))
        cmd = [sys.executable, __file__, "--sizes", sizes_arg, "--repeat", str(repeat), "--json"]
        other = {int(k): v for k, v in json.loads(subprocess.check_output(cmd, env=env)).items()}
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    head = "| phase end | pods | p50 | min | p50 per pod µs |"
    rule = "|---|---:|---:|---:|---:|"
    if other is not None:
        head += f" {against} p50 | its / this p50 |"
        rule += "---:|---:|"
    out = [
        f"[machine: {os.cpu_count()} cores; load average {load}]",
        f"decide() at a phase's end, ms; p50 and min over {repeat} repeats",
        "",
        head,
        rule,
    ]
    for name in ENDS:
        for n in sizes:
            t = mine[n][name]
            p50 = statistics.median(t)
            row = f"| {name} | {n} | {p50 * 1e3:.2f} | {min(t) * 1e3:.2f} | {p50 / n * 1e6:.1f} |"
            if other is not None:
                theirs = statistics.median(other[n][name])
                row += f" {theirs * 1e3:.2f} | {theirs / p50:.2f}x |"
            out.append(row)
    return "\n".join(out)


@pytest.mark.bench
def test_decide_cost(request: pytest.FixtureRequest) -> None:
    if "bench" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("benchmark: run with -m bench")
    print("\n" + table([64, 512, 1024], 30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,512,1024")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--against", type=Path, default=None, help="also time DIR/operator's decide")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the --against subprocess
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.json:
        print(json.dumps({n: measure(n, args.repeat) for n in sizes}))
        return
    print(table(sizes, args.repeat, args.against))


if __name__ == "__main__":
    main()
