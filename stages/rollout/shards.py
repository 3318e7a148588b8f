"""Multi-worker rollouts: shard arguments, shard file names and the merge into ``steps.parquet``."""

from __future__ import annotations

import polars as pl

from schemas import read_table, validate_steps, write_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import Run
from stages.envs.registry import make_environment
from stages.rollout.metrics import rollout_metrics

NO_METRICS = pl.DataFrame(schema={"name": pl.String, "value": pl.Float64, "task_type": pl.String})


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise GraftError(f"--shard '{text}': expected I/N, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise GraftError(f"--shard '{text}': need 0 <= I < N")
    return i, n


def shard_name(table: str, shard: tuple[int, int]) -> str:
    return f"{table}.shard-{shard[0]}-of-{shard[1]}.parquet"


def merge_rollout_shards(run: Run, iteration: int, config: Config, shards: int) -> bool:
    """Merge ``steps.shard-*-of-N`` (and their metrics) into ``steps.parquet`` once all N exist.

    Rows are ordered by (group_id, traj_id, step), the order of an unsharded rollout. Metrics are
    recomputed from the merged rows; ``seconds`` is the slowest shard's, and the counts the steps cannot
    show (``env_errors`` with tasks whose reset failed, ``prompt_truncated``, ``prompt_tokens_cached``)
    are the shards' sums, so the rows are an unsharded rollout's plus ``shards``. The shard files are
    removed after the merge.
    Returns True when ``steps.parquet`` exists afterwards.
    """
    if run.stage_complete("rollout", iteration):
        return True
    names = [(0 + i, shards) for i in range(shards)]
    step_files = [run.iter_dir(iteration) / shard_name("steps", s) for s in names]
    metric_files = [run.iter_dir(iteration) / shard_name("metrics_rollout", s) for s in names]
    if not all(p.is_file() for p in step_files):
        return False
    try:
        steps = pl.concat([read_table(p, "steps") for p in step_files]).sort("group_id", "traj_id", "step")
        shard_rows = pl.concat(
            [read_table(p, "metrics") for p in metric_files if p.is_file()] or [NO_METRICS]
        ).filter(pl.col("task_type").is_null())
    except GraftError:
        # another worker merged and removed the shards between our checks
        return run.stage_complete("rollout", iteration)
    validate_steps(steps, source=f"{run.iter_dir(iteration)}/steps.shard-*-of-{shards}.parquet")
    env = make_environment(config)
    seconds = float(shard_rows.filter(pl.col("name") == "seconds")["value"].max() or 0.0)
    extra = {"seconds": seconds, "steps_per_second": steps.height / seconds if seconds > 0 else 0.0}
    for name in ("prompt_truncated", "env_errors", "prompt_tokens_cached"):
        counts = shard_rows.filter(pl.col("name") == name)["value"]
        if name != "prompt_tokens_cached" or counts.len():  # only engines with a prefix cache count it
            extra[name] = float(counts.sum())
    metrics = rollout_metrics(
        steps, float(env.success_outcome), iteration, {**extra, "shards": float(shards)}
    )
    write_table(metrics, "metrics", run.iter_dir(iteration) / "metrics_rollout.parquet")
    run.write(iteration, "steps", steps)
    for path in step_files + metric_files:
        path.unlink(missing_ok=True)
    return True
