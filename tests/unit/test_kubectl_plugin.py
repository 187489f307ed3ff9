"""`kubectl rljob status` rendering, from a status the lifecycle machine produced."""

from __future__ import annotations

from lifecycle_world import World, make_spec

from rljob.cli.kubectl_plugin import render


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
