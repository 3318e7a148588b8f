"""The rollout stage runner: the iteration's (group, task) pairs; play them (or a shard's share) and write
the outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from schemas import validate_steps, write_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.initial_model import acting_policy
from schemas.rundir import Run
from stages.credit.advantage.oracle import BENCH_ORACLES
from stages.envs.base import Environment, Task, environment_tasks
from stages.envs.registry import make_environment
from stages.play.collect import ProgressHook, collect_episodes
from stages.play.settings import PlaySettings
from stages.policy.engine import PolicyEngine
from stages.policy.live_engine import live_engine
from stages.policy.sampling import derive_rng
from stages.rollout.metrics import rollout_metrics
from stages.rollout.oracle import iteration_tasks, play_oracle
from stages.rollout.shards import merge_rollout_shards, shard_name


def iteration_groups(env: Environment, config: Config, iteration: int) -> list[tuple[int, Task]]:
    """The iteration's (group index, task) pairs: ``rollout.groups`` tasks drawn from the fixed ``train``
    set of ``env.train_tasks`` tasks (seeded by run seed), without replacement while they last."""
    pool = environment_tasks(env, "train", config.env.train_tasks, config.run.seed)
    if not pool:
        raise GraftError(f"environment '{config.env.name}' returned no train tasks")
    rng = derive_rng(config.run.seed, iteration, "rollout-tasks")
    n = config.rollout.groups
    picks = rng.choice(len(pool), size=n, replace=n > len(pool))
    return [(g, pool[int(i)]) for g, i in enumerate(picks)]


def collect_groups(
    engine: PolicyEngine,
    env: Environment,
    groups: Sequence[tuple[int, Task]],
    config: Config,
    iteration: int,
    version: str,
    *,
    settings: PlaySettings | None = None,
    progress: bool | ProgressHook | None = None,
    stats: dict[str, float] | None = None,
) -> pl.DataFrame:
    """``collect_episodes`` of the (group index, task) pairs ``groups`` with the config's rollout settings
    (``settings``: None = ``PlaySettings.from_config(config)``; a bench passes its own mode or limits)."""
    return collect_episodes(
        engine,
        env,
        [t for _, t in groups],
        config.rollout.group_size,
        PlaySettings.from_config(config) if settings is None else settings,
        seed=config.run.seed,
        iteration=iteration,
        policy_version=version,
        progress=progress,
        group_ids=[g for g, _ in groups],
        group_count=config.rollout.groups,
        stats=stats,
    )


def rollout_iteration(
    config: Config,
    iteration: int,
    model_dir: Path,
    version: str,
    *,
    shard: tuple[int, int] | None = None,
    progress: bool | ProgressHook | None = None,
    env: Environment | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Play the iteration's groups (or a shard's share) with ``model_dir``; return (steps, metrics).

    ``env``: an environment of ``config`` to reuse (a Ray rollout actor keeps one between iterations);
    None builds one."""
    steps, metrics, _ = _play_iteration(
        config, iteration, model_dir, version, shard=shard, progress=progress, env=env, oracle=False
    )
    return steps, metrics


def _play_iteration(
    config: Config,
    iteration: int,
    model_dir: Path,
    version: str,
    *,
    shard: tuple[int, int] | None,
    progress: bool | ProgressHook | None,
    env: Environment | None,
    oracle: bool,
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame | None]:
    """rollout_iteration, and with ``oracle`` the bench oracle's table (stages.rollout.oracle)."""
    import torch

    from stages.policy.models import resolve_device

    start = time.perf_counter()
    torch.set_num_threads(max(1, config.run.torch_threads))
    resolve_device(config.run.device)  # a clear error before any work when CUDA is asked for but absent
    env = make_environment(config) if env is None else env
    groups = iteration_groups(env, config, iteration)
    if shard is not None:
        groups = [(g, t) for g, t in groups if g % shard[1] == shard[0]]
    if not groups:
        raise GraftError(
            f"rollout: shard {shard} of iteration {iteration} has no groups (rollout.groups too small)"
        )
    engine = live_engine(config, model_dir, version)
    stats: dict[str, float] = {}
    steps = collect_groups(engine, env, groups, config, iteration, version, progress=progress, stats=stats)
    validate_steps(steps, source=f"rollout of iteration {iteration}")
    seconds = time.perf_counter() - start
    extra = {
        "seconds": seconds,
        "steps_per_second": steps.height / seconds if seconds > 0 else 0.0,
        "prompt_truncated": stats.get("prompt_truncated", 0.0),
        "env_errors": stats.get("env_errors", 0.0),  # includes tasks whose reset failed (no rows)
    }
    if "prompt_tokens_cached" in stats:  # prompt tokens the engine's prefix cache served (vLLM)
        extra["prompt_tokens_cached"] = stats["prompt_tokens_cached"]
    table = None
    if oracle:  # after the rollout's own timing: its cost is reported on its own (oracle_seconds)
        table, cost = play_oracle(
            engine,
            env,
            steps,
            iteration_tasks(groups),
            config.advantage.oracle_continuations,
            config.solve.gamma,
            PlaySettings.from_config(config),
            seed=config.run.seed,
            iteration=iteration,
            version=version,
        )
        extra.update(cost)
    return steps, rollout_metrics(steps, float(env.success_outcome), iteration, extra), table


def run_rollout(
    run: Run,
    iteration: int,
    config: Config,
    *,
    shard: tuple[int, int] | None = None,
    progress: bool | ProgressHook | None = None,
) -> Path:
    """Stage runner: ``iter_NNNN/metrics_rollout.parquet`` then ``iter_NNNN/steps.parquet`` (atomic).

    The policy is the checkpoint of iteration - 1 (an error when missing), the initial model in iteration 0.
    With ``shard=(i, n)`` only groups g with g % n == i are played and the outputs are
    ``steps.shard-i-of-n.parquet`` / ``metrics_rollout.shard-i-of-n.parquet``; a finished shard is not
    replayed, and whichever worker finds all n shards present merges them into ``steps.parquet``
    (``merge_rollout_shards``), which is all the graph stage reads. Returns the steps path (the shard
    file when the merge is still waiting for other workers).
    """
    oracle = config.advantage.estimator in BENCH_ORACLES
    if oracle and shard is not None:
        raise GraftError(
            f"advantage.estimator = '{config.advantage.estimator}' plays its continuations in the rollout "
            "stage, which it does unsharded only (leave out --shard and --executor ray)"
        )
    model_dir, version = acting_policy(run, iteration, config, "rollout")
    if shard is None:
        steps, metrics, table = _play_iteration(
            config, iteration, model_dir, version, shard=None, progress=progress, env=None, oracle=oracle
        )
        write_table(metrics, "metrics", run.iter_dir(iteration) / "metrics_rollout.parquet")
        if table is not None:
            run.write(iteration, "oracle", table)
        return run.write(iteration, "steps", steps)
    steps_path = run.iter_dir(iteration) / shard_name("steps", shard)
    if not steps_path.is_file() and not run.stage_complete("rollout", iteration):
        steps, metrics = rollout_iteration(
            config, iteration, model_dir, version, shard=shard, progress=progress
        )
        write_table(metrics, "metrics", run.iter_dir(iteration) / shard_name("metrics_rollout", shard))
        write_table(steps, "steps", steps_path)
    if merge_rollout_shards(run, iteration, config, shard[1]):
        return run.table_path(iteration, "steps")
    return steps_path
