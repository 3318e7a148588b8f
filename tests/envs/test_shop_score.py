"""The WebShop task score is recorded per episode and reported beside success."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from schemas import read_table, write_table
from schemas.config import Config
from schemas.rundir import create_run
from stages.envs.base import Episode
from stages.envs.registry import make_env
from stages.evaluate import eval_rows
from stages.observe.report import RunTables, per_type_table
from stages.play.collect import _row, _Slot, _steps_frame, _Turn
from stages.rollout.metrics import rollout_metrics


def _play(env, task, script) -> _Slot:
    """One episode played by ``script(game)`` -> action, its rows built as the rollout builds them."""
    episode = Episode(env, task)
    slot = _Slot(0, 0, task, episode, np.random.default_rng(0))
    while not episode.done:
        action = script(episode.game)
        turn = _Turn(f"prompt {len(slot.rows)}", [1], action, [2], [-0.5], action, None)
        slot.rows.append(_row(slot, episode.act(action), turn))
    return slot


def _partial_purchase(task):
    """Go to the goal item and buy it without choosing any option: a partly matching purchase."""
    goal_type = task.spec["goal"]["type"]

    def script(game) -> str:
        if game.at.kind == "search":
            return f"search[{goal_type}]"
        expert = game.expert_action()
        return "click[buy now]" if game.at.kind == "item" and not expert.startswith("click[<") else expert

    return script


def test_partial_purchase_score_is_recorded_and_reported(tmp_path):
    env = make_env("shop", max_turns=15, invalid_penalty=-0.1, data="")
    task = env.tasks("eval", 1, seed=0)[0]
    partial = _play(env, task, _partial_purchase(task))
    perfect = _play(env, task, lambda game: game.expert_action())
    perfect.rollout = 1
    goal = task.spec["goal"]
    expected = (len(goal["attributes"]) + 1) / (len(goal["attributes"]) + len(goal["options"]) + 1)
    score = partial.episode.score
    assert score == pytest.approx(expected) and 0.0 < score < 1.0 and partial.episode.outcome == 0.0
    assert perfect.episode.score == 1.0 and perfect.episode.won
    steps = _steps_frame([partial, perfect], 0, "v", 1, 1)
    path = write_table(steps, "steps", tmp_path / "steps.parquet")
    stored = read_table(path, "steps")
    by_traj = stored.group_by("traj_id", maintain_order=True).agg(pl.col("score").unique())
    assert [s.to_list() for s in by_traj["score"]] == [[pytest.approx(expected)], [1.0]]

    # eval: Score = mean task score, Success = share of score-1 purchases, side by side.
    rows = eval_rows(stored, 10.0, 0, "ck").filter(pl.col("task_type").is_null())
    values = dict(zip(rows["name"], rows["value"], strict=True))
    assert values["success_rate"] == 0.5
    assert values["mean_score"] == pytest.approx((expected + 1.0) / 2)
    metrics = rollout_metrics(stored, 10.0, 0).filter(pl.col("task_type").is_null())
    assert dict(zip(metrics["name"], metrics["value"], strict=True))["mean_score"] == pytest.approx(
        (expected + 1.0) / 2
    )

    # report: a shop run's table has Score next to All (success), even where they would agree.
    evals = eval_rows(stored, 10.0, 0, "ck").with_columns(pl.lit(1).alias("x"))
    empty = pl.DataFrame(schema={"iter": pl.Int32, "stage": pl.String, "name": pl.String,
                                 "value": pl.Float64, "task_type": pl.String, "x": pl.Int32})  # fmt: skip
    header, _, line = per_type_table([RunTables("shop", empty, evals, "shop")]).splitlines()
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert header.split("|")[-4:-1] == [" All (± s.e.) ", " Score ", " Episodes "]
    assert cells[-3:] == ["50.0 ± 50.0", f"{100 * (expected + 1.0) / 2:.1f}", "2"]  # s.e. √(0.25 / 1)
    agree = evals.with_columns(
        value=pl.when(pl.col("name") == "mean_score").then(0.5).otherwise(pl.col("value"))
    )
    assert "Score" in per_type_table([RunTables("shop", empty, agree, "shop")]).splitlines()[0]
    assert "Score" not in per_type_table([RunTables("h", empty, agree, "household")]).splitlines()[0]


def test_report_reads_the_env_of_a_run(tmp_path):
    from schemas.rundir import open_run
    from stages.observe.report import load_run_tables

    config = Config()
    config.env.name = "shop"
    create_run(tmp_path / "r", config)
    assert load_run_tables(open_run(tmp_path / "r")).env == "shop"
