"""``eval.draws``: which random draws an evaluation plays (common random numbers across evaluations)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from schemas.rundir import open_run
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
    rows = [eval_runner.evaluate_model(run, config, model, it, "same") for it in (0, 5)]
    return played, rows


def test_common_draws_play_the_same_streams_and_score_the_same_weights_the_same(finished_run, monkeypatch):
    played, rows = _evaluate_twice(finished_run, "common", monkeypatch)
    assert played[0] == played[1]
    assert rows[0].drop("iter").equals(rows[1].drop("iter"))


def test_per_iteration_draws_differ_between_evaluations(finished_run, monkeypatch):
    played, _ = _evaluate_twice(finished_run, "iteration", monkeypatch)
    assert played[0]["seed"] != played[1]["seed"]
    assert played[0]["actions"] != played[1]["actions"]  # 8 episodes at T = 1: other samples
