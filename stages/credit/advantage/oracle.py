"""The Monte-Carlo oracle (a bench oracle, VinePPO-style): step advantages from continuations of the
acting policy played in the environment itself, not from the rollouts alone.

For every distinct start ``(group, t, s_t)`` of a group's rollouts, K continuations of the current
policy from s_t (the world restored by replaying the first trajectory's actions up to t) estimate

    V̂(s_t) = (1/K) Σ_k G_k,   G = Σ_{j<n} γ^j r_j + γ^n R        (n turns played, R its outcome)

the graph stage's convention that an episode's end carries its outcome (docs/design.md §4). The
worlds are deterministic given the task and the actions, so the Q of the taken action needs no
continuations of its own:

    Q̂(s_t, a_t) = r_t + γ · (R if the episode ended at t else V̂(s_{t+1}))
    A_t = Q̂ − V̂(s_t)

A start is keyed by the turn as well as the state: the turns left are part of what the policy can
still reach (an episode is cut at max turns). Cost: K continuations per distinct start, each at most
``max_turns − t`` policy turns; the rollout stage reports both (``oracle_*`` metrics).

This module is the pure part: which starts to play (``oracle_starts``), the returns of played
continuations (``continuation_returns``), the table they make (``oracle_table``) and the estimator.
The continuations themselves are played where the environment and the policy are (the rollout stage,
``stages.rollout.oracle``), which writes ``oracle.parquet``; the advantage stage hands it to the
estimator as ``CreditInputs.oracle``. So the credit stages never play.

``advantage`` = A scaled to unit standard deviation over the batch (so the update's step size is that of
the normalized estimators; signs and ratios are A's); ``td`` and ``gae`` hold A in reward units.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from schemas import conform
from schemas.config import AdvantageConfig
from schemas.errors import GraftError
from stages.credit.advantage.registry import CreditInputs, CreditOutput, register

ORACLE = "oracle"
# estimators that read the oracle table (they play the environment: bench oracles, not credit
# assignment from rollouts)
BENCH_ORACLES = frozenset({ORACLE})
SCALE_EPS = 1e-6
START_KEY = ["group_id", "step", "state"]


def oracle_starts(steps: pl.DataFrame) -> pl.DataFrame:
    """The distinct starts ``(group_id, step, state)`` of ``steps``, each with the trajectory that
    first reached it (smallest traj_id) and that trajectory's actions before it.

    Columns: group_id, step, state, traj_id, task_id, prefix_actions (list[str]), prefix_valid
    (list[bool]); sorted by (group_id, step, state).
    """
    rows = steps.select("group_id", "task_id", "traj_id", "step", "state", "action", "valid").sort(
        "traj_id", "step"
    )
    firsts = rows.group_by(START_KEY, maintain_order=True).agg(pl.col("traj_id").min()).sort(START_KEY)
    per_traj = rows.group_by("traj_id", maintain_order=True).agg("action", "valid", pl.col("task_id").first())
    actions = dict(zip(per_traj["traj_id"], per_traj["action"], strict=True))
    valids = dict(zip(per_traj["traj_id"], per_traj["valid"], strict=True))
    tasks = dict(zip(per_traj["traj_id"], per_traj["task_id"], strict=True))
    prefix_actions, prefix_valid, task_ids = [], [], []
    for traj, t in zip(firsts["traj_id"], firsts["step"], strict=True):
        prefix_actions.append(list(actions[traj][:t]))
        prefix_valid.append(list(valids[traj][:t]))
        task_ids.append(tasks[traj])
    return firsts.with_columns(
        task_id=pl.Series(task_ids, dtype=pl.String),
        prefix_actions=pl.Series(prefix_actions, dtype=pl.List(pl.String)),
        prefix_valid=pl.Series(prefix_valid, dtype=pl.List(pl.Boolean)),
    )


def continuation_returns(continuations: pl.DataFrame, gamma: float) -> pl.DataFrame:
    """Per continuation (``traj_id``): ``G = Σ_{j<n} γ^j r_j + γ^n R`` and ``n`` (its turns), from its
    steps rows (``step`` counted from 0 at the start, ``reward``, ``outcome``)."""
    return (
        continuations.group_by("traj_id", maintain_order=True)
        .agg(
            (pl.col("reward") * pl.lit(gamma).pow(pl.col("step"))).sum().alias("discounted"),
            pl.len().alias("turns"),
            pl.col("outcome").first(),
        )
        .select(
            "traj_id",
            (pl.col("discounted") + pl.lit(gamma).pow(pl.col("turns")) * pl.col("outcome")).alias("ret"),
            pl.col("turns").cast(pl.Int32),
        )
    )


def oracle_table(
    starts: pl.DataFrame, returns: Sequence[np.ndarray], turns: Sequence[int] | None = None
) -> pl.DataFrame:
    """The ``oracle`` table: per start (a row of ``starts``), the mean, std and count of its
    continuations' returns ``returns[i]`` (shape (K_i,)), and the turns they took."""
    if len(returns) != starts.height:
        raise ValueError("one array of returns per start")
    counts = np.array([len(r) for r in returns], dtype=np.int32)
    if (counts < 1).any():
        raise GraftError("oracle: a start without continuations has no value")
    means = np.array([float(np.mean(r)) for r in returns])
    stds = np.array([float(np.std(r, ddof=1)) if len(r) > 1 else 0.0 for r in returns])
    table = starts.select(START_KEY).with_columns(
        value=pl.Series(means),
        return_std=pl.Series(stds),
        continuations=pl.Series(counts),
        turns=pl.Series(np.zeros(len(returns), np.int32) if turns is None else np.asarray(turns, np.int32)),
    )
    return pl.from_arrow(conform(table, "oracle", source="<oracle>"))  # type: ignore[return-value]


def oracle_step_advantages(steps: pl.DataFrame, oracle: pl.DataFrame, gamma: float) -> np.ndarray:
    """``A_t = r_t + γ (R if done_t else V̂(s_{t+1})) − V̂(s_t)`` per steps row (shape (n,), reward units).

    V̂(s_t) is the oracle's value of ``(group_id, step, state)``, V̂(s_{t+1}) that of ``(group_id,
    step + 1, next_state)``; a start the table lacks is a GraftError."""
    values = oracle.select(
        pl.col("group_id"), pl.col("step").cast(pl.Int32), pl.col("state"), pl.col("value")
    )
    rows = steps.select(
        "group_id", pl.col("step").cast(pl.Int32), "state", "next_state", "reward", "outcome", "done"
    ).with_row_index("_row")
    here = rows.join(values, on=START_KEY, how="left")
    nxt = values.rename({"state": "next_state", "value": "next_value"}).with_columns(pl.col("step") - 1)
    both = here.join(nxt, on=["group_id", "step", "next_state"], how="left").sort("_row")
    missing = both.filter(pl.col("value").is_null() | (~pl.col("done") & pl.col("next_value").is_null()))
    if missing.height:
        row = missing.row(0, named=True)
        raise GraftError(
            f"estimator 'oracle': the oracle table has no value for group {row['group_id']!r}, turn "
            f"{row['step']} (or the turn after it): it was not played from these steps"
        )
    v = both["value"].to_numpy()
    after = np.where(
        both["done"].to_numpy(), both["outcome"].to_numpy(), both["next_value"].fill_null(0.0).to_numpy()
    )
    return both["reward"].to_numpy() + gamma * after - v


@register(ORACLE)
def oracle(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """Monte-Carlo oracle credit (bench oracle; module docstring): ``A_t = Q̂ − V̂(s_t)`` from the
    rollout stage's continuations, ``advantage = A / (std_batch(A) + 1e-6)``."""
    if inputs.oracle is None:
        raise GraftError(
            "estimator 'oracle' is a bench oracle: its values come from continuations played in the "
            "rollout stage (oracle.parquet, written when advantage.estimator = 'oracle'); none were given"
        )
    raw = oracle_step_advantages(inputs.steps, inputs.oracle, inputs.gamma)
    scale = float(np.std(raw)) if raw.size else 0.0
    n = raw.size
    return CreditOutput(
        advantage=raw / (scale + SCALE_EPS),
        norm_group_size=np.full(n, max(n, 1), dtype=np.int32),
        td=raw,
        gae=raw,
    )
