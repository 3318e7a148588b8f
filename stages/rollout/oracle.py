"""The bench oracle's continuations: K episodes of the acting policy from every distinct start of the
rollout, played here because this stage has the environment and the policy (the credit stages only
read the table; stages.credit.advantage.oracle has the definitions).

A start ``(group, t, s_t)`` is restored by replaying, on a fresh game of the group's task, the actions
of the first trajectory that reached it (the worlds are deterministic given the task and the actions;
a plug-in world that is not is outside what the oracle measures). Continuations are played in
lockstep like the rollout, with their own random streams (``"oracle-episode"``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import polars as pl

from stages.credit.advantage.oracle import continuation_returns, oracle_starts, oracle_table
from stages.envs.base import Environment, Task
from stages.play.collect import collect_episodes
from stages.play.settings import PlaySettings
from stages.policy.engine import PolicyEngine


def play_oracle(
    engine: PolicyEngine,
    env: Environment,
    steps: pl.DataFrame,
    tasks: dict[str, Task],
    continuations: int,
    gamma: float,
    settings: PlaySettings,
    *,
    seed: int,
    iteration: int,
    version: str,
) -> tuple[pl.DataFrame, dict[str, float]]:
    """The ``oracle`` table of ``steps`` (K = ``continuations`` per distinct start) and its cost:
    ``oracle_starts``, ``oracle_continuations`` (episodes played), ``oracle_turns`` (policy turns they
    took), ``oracle_turns_per_step`` (over the rollout's turns), ``oracle_seconds``."""
    start = time.perf_counter()
    starts = oracle_starts(steps)
    played = collect_episodes(
        engine,
        env,
        [tasks[t] for t in starts["task_id"]],
        continuations,
        settings,
        seed=seed,
        iteration=iteration,
        policy_version=version,
        progress=False,
        prefixes=[
            list(zip(a, v, strict=True))
            for a, v in zip(starts["prefix_actions"], starts["prefix_valid"], strict=True)
        ],
        stream="oracle",
    )
    returns = continuation_returns(played, gamma)
    # collect names continuation k of start i "i0003-g<i>-r<k>": start i's rows share the group part
    owner = returns["traj_id"].str.replace(r"-r\d+$", "")
    digits = max(2, len(str(max(starts.height - 1, 0))))
    by_start: dict[str, list[float]] = {}
    turns: dict[str, int] = {}
    for key, ret, n in zip(owner, returns["ret"], returns["turns"], strict=True):
        by_start.setdefault(key, []).append(float(ret))
        turns[key] = turns.get(key, 0) + int(n)
    keys = [f"i{iteration:04d}-g{i:0{digits}d}" for i in range(starts.height)]
    table = oracle_table(
        starts,
        [np.asarray(by_start.get(k, []), dtype=np.float64) for k in keys],
        [turns.get(k, 0) for k in keys],
    )
    cost = {
        "oracle_starts": float(starts.height),
        "oracle_continuations": float(returns.height),
        "oracle_turns": float(played.height),
        "oracle_turns_per_step": played.height / steps.height if steps.height else 0.0,
        "oracle_seconds": time.perf_counter() - start,
    }
    return table, cost


def iteration_tasks(groups: Sequence[tuple[int, Task]]) -> dict[str, Task]:
    """task_id -> Task of the iteration's groups."""
    return {t.task_id: t for _, t in groups}
