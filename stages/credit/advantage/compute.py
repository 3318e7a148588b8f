"""Run one registered estimator over a steps table and return the advantages table (schemas ADVANTAGES)."""

from __future__ import annotations

import numpy as np
import polars as pl

from schemas.config import AdvantageConfig
from schemas.errors import GraftError
from stages.credit.advantage.registry import CreditInputs, get_estimator
from stages.credit.bellman import GraphIndex


def _column(values: np.ndarray | None, n: int, name: str, estimator: str) -> pl.Series:
    if values is None:
        return pl.Series(name, [None] * n, dtype=pl.Float64)
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != (n,):
        raise GraftError(f"estimator '{estimator}' returned {name} of shape {arr.shape}, expected ({n},)")
    return pl.Series(name, arr)


def flat_group_rows(steps: pl.DataFrame) -> pl.Series:
    """True on the rows of groups whose trajectories all have the same outcome (no outcome signal)."""
    return steps.select(
        flat=pl.col("outcome").min().over("group_id") == pl.col("outcome").max().over("group_id")
    )["flat"]


def compute_advantages(
    steps: pl.DataFrame,
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    values: pl.DataFrame | None,
    config: AdvantageConfig,
    gamma: float,
    index: GraphIndex | None = None,
    step_rewards: str = "step",
    oracle: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Advantages table, one row per steps row in the same order, from estimator ``config.estimator``.

    ``edges`` must be row-aligned with ``steps`` (the graph stage's output for these steps);
    ``index``: stages.credit.bellman.index_graph(nodes, edges) when the caller already has it;
    ``step_rewards``: the solve.step_rewards the values were computed with; ``oracle``: the rollout
    stage's ``oracle`` table (bench oracles only, stages.credit.advantage.oracle).
    With ``config.flat_groups = "zero"`` every row of a group whose outcomes do not vary gets
    advantage 0, whatever the estimator (td and gae stay as computed).
    """
    if edges.height != steps.height:
        raise GraftError(f"edges has {edges.height} rows but steps has {steps.height}; rebuild the graph")
    same = edges.select("traj_id", "step").equals(steps.select("traj_id", pl.col("step").cast(pl.Int32)))
    if not same:
        raise GraftError("edges rows do not match the steps rows (traj_id, step); rebuild the graph")
    name = config.estimator
    estimator = get_estimator(name)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # non-finite results are named below
        out = estimator(
            CreditInputs(
                steps=steps,
                edges=edges,
                nodes=nodes,
                values=values,
                gamma=gamma,
                index=index,
                step_rewards=step_rewards,
                oracle=oracle,
            ),
            config,
        )
    n = steps.height
    advantage = _column(out.advantage, n, "advantage", name)
    if config.flat_groups == "zero" and n:
        advantage = advantage * (~flat_group_rows(steps)).cast(pl.Float64)
    if advantage.is_nan().any() or not np.isfinite(advantage.to_numpy()).all():
        raise GraftError(
            f"estimator '{name}' produced non-finite advantages (the steps' rewards or outcomes are not "
            "finite, or overflow float64)"
        )
    size = np.asarray(out.norm_group_size)
    if size.shape != (n,):
        raise GraftError(
            f"estimator '{name}' returned norm_group_size of shape {size.shape}, expected ({n},)"
        )
    return pl.DataFrame(
        {
            "group_id": edges["group_id"],
            "traj_id": edges["traj_id"],
            "step": edges["step"],
            "estimator": pl.Series([name] * n, dtype=pl.String) if n else pl.Series([], dtype=pl.String),
            "td": _column(out.td, n, "td", name),
            "gae": _column(out.gae, n, "gae", name),
            "advantage": advantage,
            "norm_group_size": pl.Series(size.astype(np.int32)),
        }
    )
