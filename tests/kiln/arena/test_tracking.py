"""Tests of kiln/arena/tracking.py: each vote logs counts and ratings to one MLflow run per arena."""

from __future__ import annotations

from kiln.arena.session import Arena
from tests.kiln.arena.test_session import PROMPTS, side_of, stand_ins


def test_each_vote_logs_counts_and_ratings_to_one_mlflow_run_per_arena(tmp_path):
    from mlflow.tracking import MlflowClient

    from kiln.arena.tracking import ArenaTracker, metric_name

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    people, _ = stand_ins()
    people[1].name = "models:/kiln-demo@candidate"
    make = lambda arena_id, members: ArenaTracker(uri, arena_id, members, tmp_path / "mlartifacts", "p.yaml")  # noqa: E731
    arena = Arena(people, PROMPTS, tmp_path / "arena", tracker_factory=make)
    for choice in ("A", "A", "tie"):
        r = arena.round()
        assert arena.vote(r.id, side_of(arena, r, choice) if choice in "AB" else choice)["tracking"] == "ok"
    arena.close()
    b = metric_name(people[1].name)
    assert b == "models_kiln-demo_candidate"
    client = MlflowClient(uri)
    run = client.get_run(arena.tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kiln.arena_id"] == arena.id
    assert run.data.params[f"model.{b}"] == "models:/kiln-demo@candidate" and run.data.params["model.A.weights"] == "wAwAwAwA"
    assert run.data.metrics["votes"] == 3 and run.data.metrics["votes.tie"] == 1 and run.data.metrics["wins.A"] == 2
    assert run.data.metrics["rating.A"] > 1000 > run.data.metrics[f"rating.{b}"]
    assert run.data.metrics["low.A"] <= run.data.metrics["rating.A"] <= run.data.metrics["high.A"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rating.A")] == [1, 2, 3]
    again = Arena(people, PROMPTS, tmp_path / "arena", tracker_factory=make)  # a restart reopens the same run
    assert again.tracker.run_id == arena.tracker.run_id and client.get_run(again.tracker.run_id).info.status == "RUNNING"
    again.close()
