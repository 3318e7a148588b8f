"""Evaluation on held-out tasks (SPEC §8, ``graft eval``).

The policy of a checkpoint plays ``config.env.eval_tasks`` tasks of the environment's ``eval`` split
(``config.eval.group_size`` episodes each) at ``config.eval.temperature``; the episodes are reduced to
long-format ``eval`` rows, overall (task_type null) and per task type, for all episodes (split null)
and, when the environment labels splits and the episodes span several (ALFWorld ``eval_split =
"both"``), per split too:

* ``success_rate``: share of episodes whose outcome reached the environment's success outcome R⁺
  (10 household/ALFWorld/shop, 1 search);
* ``mean_return``: mean of G = Σ_t r_t + R (step rewards incl. invalid-action penalties, plus outcome);
* ``mean_turns``: mean number of turns;
* ``mean_score``: mean task score in [0, 1] — the ``score`` column the rollout records (WebShop's
  partial credit for ``shop``: a purchase that matches the goal partly scores between 0 and 1 while
  its success is 0), else (null score, e.g. external tables) clip(R / R⁺, 0, 1);
* ``episodes``: number of episodes.

The standard error of a success rate is not a row: ``success_standard_error(success_rate, episodes)``
(``stages.observe.report``) derives it from the two (reports and benchmark tables print it beside the
rate).

Where it goes: the checkpoint written by the update of iteration i → ``iter_i/eval.parquet``
(iter = i); the initial policy → ``eval.parquet`` at the run root (iter = -1).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from schemas.config import Config
from schemas.errors import GraftError
from schemas.integrity import checkpoint_complete
from schemas.manifest import verify_checkpoint_read, write_recorded_table
from schemas.rundir import Run

EVAL_METRICS = ("success_rate", "mean_return", "mean_turns", "mean_score", "invalid_rate", "episodes")
EVAL_PURPOSE = 0xE7A1  # the eval stream of SeedSequence((run.seed, iteration + 1, purpose))


def episode_table(steps: pl.DataFrame, success_outcome: float) -> pl.DataFrame:
    """One row per trajectory: task_type, turns, return G = Σ r + R, success, score, invalid turns (pure).

    ``steps`` needs traj_id, task_type, step, reward, outcome (and may carry ``score``, ``valid``;
    without ``valid`` no turn counts as invalid).
    """
    fallback = (pl.col("outcome").first() / success_outcome).clip(0.0, 1.0)
    score = (
        pl.col("score").sort_by("step").last().fill_null(fallback) if "score" in steps.columns else fallback
    )
    return steps.group_by("traj_id", maintain_order=True).agg(
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


def eval_seed(run_seed: int, iteration: int) -> int:
    """Seed of the evaluation of ``iteration`` (-1 = initial policy), from SeedSequence."""
    return int(np.random.SeedSequence([run_seed, iteration + 1, EVAL_PURPOSE]).generate_state(1)[0])


def policy_dir(run: Run, iteration: int, config: Config) -> Path:
    """The model an evaluation of ``iteration`` loads: checkpoint i, or the initial model for -1."""
    if iteration < 0:
        return run.initial_policy_dir(config)
    path = run.checkpoint_dir(iteration)
    if not checkpoint_complete(path):
        raise GraftError(f"{path}: no complete checkpoint for iteration {iteration}")
    # what its finished iteration recorded, and intact (the evaluation is what gets replaced)
    return verify_checkpoint_read(run, iteration, skip=[output_path(run, iteration).name])


def output_path(run: Run, iteration: int) -> Path:
    return run.initial_eval_path if iteration < 0 else run.table_path(iteration, "eval")


def evaluate_model(
    run: Run,
    config: Config,
    model_dir: Path,
    iteration: int,
    checkpoint_name: str,
    progress: object | None = None,
) -> pl.DataFrame:
    """Play the held-out tasks with the model in ``model_dir``; return the eval rows."""
    import torch

    from stages.envs.base import environment_tasks
    from stages.envs.registry import make_environment
    from stages.play.collect import collect_episodes
    from stages.policy.live_engine import live_engine

    torch.set_num_threads(max(1, config.run.torch_threads))
    env = make_environment(config)
    tasks = environment_tasks(env, "eval", config.env.eval_tasks, config.run.seed)
    if not tasks:
        raise GraftError(f"environment '{config.env.name}' returned no eval tasks")
    engine = live_engine(config, model_dir, checkpoint_name)
    steps = collect_episodes(
        engine,
        env,
        tasks,
        config.eval.group_size,
        mode=config.rollout.mode,
        temperature=config.eval.temperature,
        history_length=config.rollout.history,
        seed=eval_seed(config.run.seed, iteration),
        iteration=max(iteration, 0),
        policy_version=checkpoint_name,
        progress=progress,
        batch_size=config.rollout.batch_size,
        batch_scope=config.rollout.batch_scope,
        max_new_tokens=config.rollout.max_new_tokens,
        max_prompt_tokens=config.rollout.max_prompt_tokens,
        max_env_errors=config.rollout.max_env_errors,
    )
    return eval_rows(
        steps, float(env.success_outcome), iteration, checkpoint_name, getattr(env, "split_of", None)
    )


def run_eval(run: Run, iteration: int, config: Config) -> None:
    """Stage runner: evaluate the checkpoint of ``iteration`` (or the initial policy for -1)."""
    model_dir = policy_dir(run, iteration, config)
    name = "initial" if iteration < 0 else model_dir.name
    rows = evaluate_model(run, config, model_dir, iteration, name)
    write_recorded_table(run, rows, "eval", output_path(run, iteration))
