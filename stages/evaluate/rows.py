"""The ``eval`` table from the steps of an evaluation (pure): episodes, their summary rows, the seed.

See the package docstring for the metrics."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

EVAL_METRICS = (
    "success_rate",
    "mean_return",
    "mean_turns",
    "mean_score",
    "invalid_rate",
    "valid_action_rate",
    "episodes",
)
EVAL_PURPOSE = 0xE7A1  # the eval stream of SeedSequence((run.seed, iteration + 1, purpose))


def episode_table(steps: pl.DataFrame, success_outcome: float) -> pl.DataFrame:
    """One row per trajectory: task_type, turns, return G = Σ r + R, success, score, invalid turns
    (pure), and task_id when the steps carry it.

    ``steps`` needs traj_id, task_type, step, reward, outcome (and may carry ``task_id``, ``score``,
    ``valid``; without ``valid`` no turn counts as invalid).
    """
    fallback = (pl.col("outcome").first() / success_outcome).clip(0.0, 1.0)
    score = (
        pl.col("score").sort_by("step").last().fill_null(fallback) if "score" in steps.columns else fallback
    )
    task = [pl.col("task_id").first()] if "task_id" in steps.columns else []
    return steps.group_by("traj_id", maintain_order=True).agg(
        *task,
        pl.col("task_type").first(),
        pl.len().cast(pl.Float64).alias("turns"),
        (pl.col("reward").sum() + pl.col("outcome").first()).alias("return"),
        (pl.col("outcome").first() >= success_outcome - 1e-9).cast(pl.Float64).alias("success"),
        score.cast(pl.Float64).alias("score"),
        ((~pl.col("valid")).sum() if "valid" in steps.columns else pl.lit(0))
        .cast(pl.Float64)
        .alias("invalid"),
    )


def summary_rows(episodes: pl.DataFrame) -> pl.DataFrame:
    """Long rows (name, value, task_type) of the eval metrics, overall (null type) and per type."""
    aggs = [
        pl.col("success").mean().alias("success_rate"),
        pl.col("return").mean().alias("mean_return"),
        pl.col("turns").mean().alias("mean_turns"),
        pl.col("score").mean().alias("mean_score"),
        # share of turns (not episodes) whose output was unparseable or inadmissible, as in rollout
        (pl.col("invalid").sum() / pl.col("turns").sum()).alias("invalid_rate"),
        # its complement: the share of turns that parsed to an admissible action
        (1.0 - pl.col("invalid").sum() / pl.col("turns").sum()).alias("valid_action_rate"),
        pl.len().cast(pl.Float64).alias("episodes"),
    ]
    overall = episodes.select(aggs).with_columns(pl.lit(None, dtype=pl.String).alias("task_type"))
    per_type = episodes.group_by("task_type").agg(aggs).sort("task_type")
    wide = pl.concat([overall, per_type.select(overall.columns)], how="vertical")
    return wide.unpivot(index="task_type", on=list(EVAL_METRICS), variable_name="name").select(
        "name", pl.col("value").cast(pl.Float64), "task_type"
    )


def eval_rows(
    steps: pl.DataFrame,
    success_outcome: float,
    iteration: int,
    checkpoint: str,
    split_of: Callable[[str], str] | None = None,
) -> pl.DataFrame:
    """The ``eval`` table of one evaluation from its steps (pure).

    Rows with ``split`` null summarize every episode. ``split_of`` (the environment's, e.g. ALFWorld's
    valid_seen / valid_unseen from the task id) adds the same rows per split when the episodes come
    from two or more splits, so in- and out-of-distribution results are reported separately.
    """
    episodes = episode_table(steps, success_outcome)
    frames = [summary_rows(episodes).with_columns(pl.lit(None, dtype=pl.String).alias("split"))]
    if split_of is not None:
        splits = steps.group_by("traj_id", maintain_order=True).agg(pl.col("task_id").first())
        labelled = episodes.with_columns(
            split=pl.Series([split_of(t) for t in splits["task_id"].to_list()], dtype=pl.String)
        )
        names = labelled["split"].unique(maintain_order=True).sort()
        if names.len() >= 2:
            for name in names.to_list():
                part = labelled.filter(pl.col("split") == name).drop("split")
                frames.append(summary_rows(part).with_columns(pl.lit(name).alias("split")))
    return pl.concat(frames).select(
        pl.lit(iteration, dtype=pl.Int32).alias("iter"),
        pl.lit(checkpoint).alias("checkpoint"),
        "name",
        "value",
        "task_type",
        "split",
    )


def eval_episode_rows(
    steps: pl.DataFrame, success_outcome: float, iteration: int, checkpoint: str
) -> pl.DataFrame:
    """The ``eval_episodes`` table of one evaluation from its steps (pure): one row per episode, in
    play order, the draws the ``eval`` rows summarize (their success_rate is the mean of ``success``).
    Under common draws every evaluation of a run plays the same traj_ids, so two evaluations pair
    episode by episode (``draw_changes``)."""
    episodes = episode_table(steps, success_outcome)
    return episodes.select(
        pl.lit(iteration, dtype=pl.Int32).alias("iter"),
        pl.lit(checkpoint).alias("checkpoint"),
        "traj_id",
        "task_id",
        "task_type",
        "success",
        "return",
        "turns",
        "score",
        "invalid",
    )


def draw_changes(before: pl.DataFrame, after: pl.DataFrame) -> dict[str, int]:
    """How the episodes of two evaluations on common draws compare, draw by draw (pure).

    Pairs the rows of two ``eval_episodes`` tables on ``traj_id`` (the same task and sampling streams
    under ``eval.draws = "common"``): ``gained`` draws failed before and succeed after, ``lost`` the
    reverse, ``kept`` succeed in both, ``failed`` fail in both, ``paired`` = their sum. The difference
    in success counts is gained − lost; gained + lost is the churn inside it, the part a paired test
    (McNemar's) weighs. Raises when the two tables do not hold the same draws.
    """
    left = before.select("traj_id", pl.col("success").alias("before"))
    right = after.select("traj_id", pl.col("success").alias("after"))
    if left["traj_id"].n_unique() != left.height or right["traj_id"].n_unique() != right.height:
        raise ValueError("draw_changes: a traj_id appears twice in one evaluation")
    paired = left.join(right, on="traj_id", how="inner")
    if paired.height != left.height or paired.height != right.height:
        raise ValueError(
            f"draw_changes: the evaluations hold different draws ({left.height} and {right.height} "
            f"episodes, {paired.height} in common); were they played with eval.draws = 'common'?"
        )
    b, a = paired["before"] > 0.5, paired["after"] > 0.5
    return {
        "gained": int((~b & a).sum()),
        "lost": int((b & ~a).sum()),
        "kept": int((b & a).sum()),
        "failed": int((~b & ~a).sum()),
        "paired": paired.height,
    }


def eval_seed(run_seed: int, iteration: int) -> int:
    """Seed of the evaluation of ``iteration`` (-1 = initial policy), from SeedSequence."""
    return int(np.random.SeedSequence([run_seed, iteration + 1, EVAL_PURPOSE]).generate_state(1)[0])
