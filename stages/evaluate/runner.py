"""The evaluation of a checkpoint: which model, where its rows go, playing the held-out tasks
(``graft eval`` and the loop's ``eval`` stage)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import polars as pl

from schemas.config import Config
from schemas.definitions import INITIAL_VERSION
from schemas.errors import GraftError
from schemas.initial_model import verified_initial_policy
from schemas.integrity import checkpoint_complete
from schemas.manifest import verify_checkpoint_read, write_recorded_table
from schemas.rundir import Run
from stages.envs.base import environment_tasks
from stages.envs.registry import make_environment
from stages.evaluate.rows import eval_episode_rows, eval_rows, eval_seed
from stages.play.collect import collect_episodes
from stages.play.settings import PlaySettings
from stages.policy.adapters import is_adapter_dir
from stages.policy.export import run_base
from stages.policy.live_engine import live_engine


def evaluated_policy(run: Run, iteration: int, config: Config) -> Path:
    """The model an evaluation of ``iteration`` scores: the checkpoint *after* update i (iteration i's
    own, where ``schemas.initial_model.acting_policy`` gives the one that acted in i), or the initial
    policy for -1."""
    if iteration < 0:
        return verified_initial_policy(run, config)
    path = run.checkpoint_dir(iteration)
    if not checkpoint_complete(path):
        raise GraftError(f"{path}: no complete checkpoint for iteration {iteration}")
    # what its finished iteration recorded, and intact (the evaluation is what gets replaced)
    verify_checkpoint_read(run, iteration, skip=[output_path(run, iteration).name, EPISODES_FILE])
    if is_adapter_dir(path):  # adapters are evaluated merged onto the run's own base, as export does
        run_base(run, path, config)
    return path


EPISODES_FILE = "eval_episodes.parquet"  # beside a run evaluation's eval.parquet


class Evaluated(NamedTuple):
    """What one evaluation computed: the ``eval`` rows and the ``eval_episodes`` rows behind them."""

    rows: pl.DataFrame
    episodes: pl.DataFrame


def output_path(run: Run, iteration: int) -> Path:
    return run.initial_eval_path if iteration < 0 else run.table_path(iteration, "eval")


def episodes_path(out: Path) -> Path | None:
    """Where the episodes of the evaluation written to ``out`` go: ``eval_episodes.parquet`` beside a
    run evaluation's ``eval.parquet`` (an iteration's, or the initial policy's at the run's top); None
    for ``eval_<name>.parquet`` of ``graft eval --checkpoint DIR`` (its rates only)."""
    return out.with_name(EPISODES_FILE) if out.name == "eval.parquet" else None


def write_evaluation(run: Run, evaluated: Evaluated, out: Path) -> Path:
    """Write an evaluation: its episodes first, then its rows to ``out``, each recorded before it is
    renamed into place; ``out`` existing means both are complete (a kill in between leaves episodes
    without rows, which the next evaluation replaces)."""
    episodes = episodes_path(out)
    if episodes is not None:
        write_recorded_table(run, evaluated.episodes, "eval_episodes", episodes)
    return write_recorded_table(run, evaluated.rows, "eval", out)


def evaluate_model(
    run: Run,
    config: Config,
    model_dir: Path,
    iteration: int,
    checkpoint_name: str,
    progress: object | None = None,
) -> Evaluated:
    """Play the held-out tasks with the model in ``model_dir``; return the eval rows and episodes."""
    import torch

    torch.set_num_threads(max(1, config.run.torch_threads))
    env = make_environment(config)
    tasks = environment_tasks(env, "eval", config.env.eval_tasks, config.run.seed)
    if not tasks:
        raise GraftError(f"environment '{config.env.name}' returned no eval tasks")
    engine = live_engine(config, model_dir, checkpoint_name)
    common = config.eval.draws == "common"  # every evaluation plays the initial policy's draws
    steps = collect_episodes(
        engine,
        env,
        tasks,
        config.eval.group_size,
        PlaySettings.from_config(config, temperature=config.eval.temperature),
        seed=eval_seed(config.run.seed, -1 if common else iteration),
        iteration=0 if common else max(iteration, 0),
        policy_version=checkpoint_name,
        progress=progress,
    )
    success = float(env.success_outcome)
    return Evaluated(
        eval_rows(steps, success, iteration, checkpoint_name, getattr(env, "split_of", None)),
        eval_episode_rows(steps, success, iteration, checkpoint_name),
    )


def run_eval(run: Run, iteration: int, config: Config) -> None:
    """Stage runner: evaluate the checkpoint of ``iteration`` (or the initial policy for -1)."""
    model_dir = evaluated_policy(run, iteration, config)
    name = INITIAL_VERSION if iteration < 0 else model_dir.name
    write_evaluation(
        run, evaluate_model(run, config, model_dir, iteration, name), output_path(run, iteration)
    )
