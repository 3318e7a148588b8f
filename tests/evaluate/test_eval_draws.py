"""``eval.draws``: which random draws an evaluation plays (common random numbers across evaluations)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from schemas.rundir import open_run
from stages.evaluate import draw_changes
from stages.evaluate import runner as eval_runner
from tests.helpers.loop_runs import micro_config, micro_run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    return micro_run(tmp_path_factory.mktemp("ref"))


def _evaluate_twice(run_dir: Path, draws: str, monkeypatch) -> tuple[list[dict], list[pl.DataFrame]]:
    """Evaluate the same weights as iteration 0 and as iteration 5; return the draws each played
    (seed, iteration of the sampling streams) and the rows each wrote."""
    config = micro_config()
    config.eval.draws = draws
    config.eval.group_size = 4
    config.eval.temperature = 1.0
    run = open_run(run_dir)
    played: list[dict] = []
    real = eval_runner.collect_episodes

    def spy(*args, **kwargs):
        played.append({"seed": kwargs["seed"], "iteration": kwargs["iteration"]})
        steps = real(*args, **kwargs)
        played[-1]["actions"] = steps["action"].to_list()
        return steps

    monkeypatch.setattr(eval_runner, "collect_episodes", spy)
    model = run.checkpoint_dir(1)
    evaluated = [eval_runner.evaluate_model(run, config, model, it, "same") for it in (0, 5)]
    return played, evaluated


def test_common_draws_play_the_same_streams_and_score_the_same_weights_the_same(finished_run, monkeypatch):
    played, evaluated = _evaluate_twice(finished_run, "common", monkeypatch)
    assert played[0] == played[1]
    assert evaluated[0].rows.drop("iter").equals(evaluated[1].rows.drop("iter"))
    # episode by episode: the same draws, the same outcomes, so nothing gained or lost
    first, second = (e.episodes for e in evaluated)
    assert first["traj_id"].to_list() == second["traj_id"].to_list()
    assert first.drop("iter").equals(second.drop("iter"))
    changes = draw_changes(first, second)
    assert changes["gained"] == changes["lost"] == 0
    assert changes["paired"] == first.height == 8


def test_the_episodes_are_what_the_rates_summarize(finished_run, monkeypatch):
    _, evaluated = _evaluate_twice(finished_run, "common", monkeypatch)
    rows, episodes = evaluated[0]
    overall = dict(
        rows.filter(pl.col("task_type").is_null() & pl.col("split").is_null())
        .select("name", "value")
        .iter_rows()
    )
    assert episodes.height == overall["episodes"]
    assert episodes["success"].mean() == pytest.approx(overall["success_rate"], abs=1e-12)
    assert episodes["turns"].mean() == pytest.approx(overall["mean_turns"], abs=1e-12)
    assert episodes["return"].mean() == pytest.approx(overall["mean_return"], abs=1e-12)
    assert set(episodes["iter"].to_list()) == {0}
    assert episodes.group_by("task_id").len()["len"].to_list() == [4] * episodes["task_id"].n_unique()


def test_per_iteration_draws_differ_between_evaluations(finished_run, monkeypatch):
    played, evaluated = _evaluate_twice(finished_run, "iteration", monkeypatch)
    assert played[0]["seed"] != played[1]["seed"]
    assert played[0]["actions"] != played[1]["actions"]  # 8 episodes at T = 1: other samples
    # their episodes carry the iteration in their traj_ids, so they do not pair
    with pytest.raises(ValueError, match="different draws"):
        draw_changes(evaluated[0].episodes, evaluated[1].episodes)


def _episodes(successes: dict[str, float]) -> pl.DataFrame:
    return pl.DataFrame({"traj_id": list(successes), "success": list(successes.values())})


def test_draw_changes_counts_each_kind_of_pair_by_hand():
    before = _episodes({"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.0})
    after = _episodes({"e": 1.0, "d": 0.0, "c": 0.0, "b": 1.0, "a": 1.0})  # another order: paired by id
    assert draw_changes(before, after) == {"gained": 2, "lost": 1, "kept": 1, "failed": 1, "paired": 5}


def test_draw_changes_refuses_draws_that_do_not_pair():
    with pytest.raises(ValueError, match="different draws"):
        draw_changes(_episodes({"a": 1.0, "b": 0.0}), _episodes({"a": 1.0, "c": 0.0}))
    with pytest.raises(ValueError, match="twice"):
        draw_changes(pl.DataFrame({"traj_id": ["a", "a"], "success": [1.0, 0.0]}), _episodes({"a": 1.0}))


def test_a_run_keeps_each_evaluations_episodes_recorded_and_queryable(finished_run):
    """The loop writes eval_episodes.parquet beside every eval.parquet (the initial policy's at the
    top, iter -1), records both in the manifests, and ``graft sql`` pairs them draw by draw."""
    import json

    from typer.testing import CliRunner

    from graft_cli.app import app
    from schemas import read_table
    from schemas.manifest import MANIFEST_FILE

    evaluated = sorted(p.parent for p in finished_run.rglob("eval.parquet"))
    assert evaluated, "the micro run evaluates"
    for folder in evaluated:
        rows = read_table(folder / "eval.parquet", "eval")
        episodes = read_table(folder / "eval_episodes.parquet", "eval_episodes")
        assert episodes["iter"].unique().to_list() == rows["iter"].unique().to_list()
        overall = rows.filter(
            pl.col("task_type").is_null() & pl.col("split").is_null() & (pl.col("name") == "success_rate")
        )
        assert episodes["success"].mean() == pytest.approx(overall["value"][0], abs=1e-12)
        files = json.loads((folder / MANIFEST_FILE).read_text())["files"]
        assert {"eval.parquet", "eval_episodes.parquet"} <= set(files)
    assert read_table(finished_run / "eval_episodes.parquet", "eval_episodes")["iter"].unique().to_list() == [
        -1
    ]
    query = "SELECT iter, count(*) AS n FROM eval_episodes GROUP BY iter ORDER BY iter"
    result = CliRunner().invoke(app, ["sql", str(finished_run), query, "--format", "csv"])
    assert result.exit_code == 0, result.output
    counts = {
        int(line.split(",")[0]): int(line.split(",")[1]) for line in result.output.split()[1:] if "," in line
    }
    want = {
        int(read_table(f / "eval_episodes.parquet", "eval_episodes")["iter"][0]): read_table(
            f / "eval_episodes.parquet", "eval_episodes"
        ).height
        for f in evaluated
    }
    assert counts == want
