"""Slow-but-obvious references for the baseline estimators, and small table builders for tests.

The references loop over rows with plain Python dicts and read the graph's φ as the exact state
string (``state`` / ``next_state``), so they share no code and no node numbering with
``stages/credit/advantage/baselines.py``. Each returns a list of floats aligned with the steps rows.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np
import polars as pl

EPS = 1e-6


@dataclass
class Traj:
    """One hand-written trajectory: states s_0..s_T, actions a_0..a_{T-1}, rewards r_0..r_{T-1}, R."""

    traj_id: str
    states: list[str]
    actions: list[str]
    rewards: list[float]
    outcome: float


def build_tables(
    groups: dict[str, list[Traj]], shuffle_seed: int | None = None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Steps and edges tables (exact φ: node ids = order of first appearance in the group)."""
    rows: list[dict] = []
    edge_rows: list[dict] = []
    for group_id, trajs in groups.items():
        node_of: dict[str, int] = {}
        for traj in trajs:
            for s in traj.states:
                node_of.setdefault(s, len(node_of))
            horizon = len(traj.actions)
            for t in range(horizon):
                last = t == horizon - 1
                rows.append(
                    {
                        "iter": 0,
                        "group_id": group_id,
                        "task_id": f"task-{group_id}",
                        "task_type": "",
                        "traj_id": traj.traj_id,
                        "step": t,
                        "state": traj.states[t],
                        "next_state": traj.states[t + 1],
                        "observation": traj.states[t],
                        "action": traj.actions[t],
                        "valid": True,
                        "reward": float(traj.rewards[t]),
                        "outcome": float(traj.outcome),
                        "done": last,
                        "terminated": last,
                        "truncated": False,
                    }
                )
                edge_rows.append(
                    {
                        "group_id": group_id,
                        "traj_id": traj.traj_id,
                        "step": t,
                        "src": node_of[traj.states[t]],
                        "dst": node_of[traj.states[t + 1]],
                        "reward": float(traj.rewards[t]),
                    }
                )
    steps = pl.DataFrame(rows).with_columns(pl.col("iter", "step").cast(pl.Int32))
    edges = pl.DataFrame(edge_rows).with_columns(pl.col("step", "src", "dst").cast(pl.Int32))
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(steps.height)
        steps, edges = steps[order], edges[order]
    return steps, edges


def random_groups(seed: int) -> dict[str, list[Traj]]:
    """Random small groups: a few trajectories walking a tiny state space, so states and
    transitions repeat across trajectories; lengths 1-5, sparse step rewards, mixed outcomes."""
    rng = np.random.default_rng(seed)
    groups: dict[str, list[Traj]] = {}
    for g in range(int(rng.integers(1, 4))):
        n_states = int(rng.integers(2, 6))
        trajs = []
        for i in range(int(rng.integers(1, 6))):
            length = int(rng.integers(1, 6))
            states = ["s0"] + [f"s{rng.integers(n_states)}" for _ in range(length)]
            actions = [f"a{rng.integers(3)}" for _ in range(length)]
            rewards = [float(rng.choice([0.0, 0.0, -0.1, 0.5])) for _ in range(length)]
            outcome = float(rng.choice([0.0, 10.0, 10.0, 1.5, -2.0]))
            trajs.append(Traj(f"g{g}-t{i}", states, actions, rewards, outcome))
        groups[f"g{g}"] = trajs
    return groups


# ----------------------------------------------------------------------------------------------------
# References (row loops)


def _records(steps: pl.DataFrame) -> list[dict]:
    return steps.to_dicts()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std1(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _znorm(x: float, xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    return (x - _mean(xs)) / (_std1(xs) + EPS)


def _traj_returns(recs: list[dict]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    outcome: dict[str, float] = {}
    for r in recs:
        total[r["traj_id"]] += r["reward"]
        outcome[r["traj_id"]] = r["outcome"]
    return {t: total[t] + outcome[t] for t in total}


def _trajs_of_group(recs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for r in recs:
        if r["traj_id"] not in out[r["group_id"]]:
            out[r["group_id"]].append(r["traj_id"])
    return out


def ref_grpo(steps: pl.DataFrame) -> list[float]:
    recs = _records(steps)
    ret = _traj_returns(recs)
    members = _trajs_of_group(recs)
    return [_znorm(ret[r["traj_id"]], [ret[t] for t in members[r["group_id"]]]) for r in recs]


def ref_rloo(steps: pl.DataFrame) -> list[float]:
    recs = _records(steps)
    ret = _traj_returns(recs)
    members = _trajs_of_group(recs)
    out = []
    for r in recs:
        others = [ret[t] for t in members[r["group_id"]] if t != r["traj_id"]]
        out.append(ret[r["traj_id"]] - _mean(others) if others else 0.0)
    return out


def ref_return_to_go(steps: pl.DataFrame, gamma: float, outcome_at_end_node: bool = False) -> list[float]:
    """R_t = r'_t + γ R_{t+1} along each trajectory; r' = r plus the outcome on the last step (times γ
    with ``outcome_at_end_node``: the outcome is then the value of the state after the last step)."""
    recs = _records(steps)
    by_traj: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in recs:
        by_traj[r["traj_id"]][r["step"]] = r
    value: dict[tuple[str, int], float] = {}
    for traj_id, rows in by_traj.items():
        running = 0.0
        last = max(rows)
        for t in range(last, -1, -1):
            terminal = rows[t]["outcome"] * (gamma if outcome_at_end_node else 1.0)
            r_prime = rows[t]["reward"] + (terminal if t == last else 0.0)
            running = r_prime + gamma * running
            value[(traj_id, t)] = running
    return [value[(r["traj_id"], r["step"])] for r in recs]


def _centre(x: float, xs: list[float], divide_std: bool) -> float:
    if len(xs) < 2:
        return 0.0
    return _znorm(x, xs) if divide_std else x - _mean(xs)


def _step_norm(recs: list[dict], x: list[float], divide_std: bool = True) -> list[float]:
    pools: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r, v in zip(recs, x, strict=True):
        pools[(r["group_id"], r["state"])].append(v)
    return [_centre(v, pools[(r["group_id"], r["state"])], divide_std) for r, v in zip(recs, x, strict=True)]


def ref_gigpo(
    steps: pl.DataFrame, omega: float, gamma: float, cross_steps: bool = False, mode: str = "mean_std_norm"
) -> list[float]:
    """GiGPO per verl-agent's definitions; ``cross_steps``: episode pool = one G per step row."""
    recs = _records(steps)
    ret = _traj_returns(recs)
    pools: dict[str, list[float]] = defaultdict(list)
    if cross_steps:
        for r in recs:
            pools[r["group_id"]].append(ret[r["traj_id"]])
    else:
        for group_id, trajs in _trajs_of_group(recs).items():
            pools[group_id] = [ret[t] for t in trajs]
    divide = mode == "mean_std_norm"
    episode = [_centre(ret[r["traj_id"]], pools[r["group_id"]], divide) for r in recs]
    step = _step_norm(recs, ref_return_to_go(steps, gamma), divide)
    return [e + omega * s for e, s in zip(episode, step, strict=True)]


def ref_salt(steps: pl.DataFrame) -> list[float]:
    recs = _records(steps)
    episode = ref_grpo(steps)
    pools: dict[tuple, list[float]] = defaultdict(list)
    key = [(r["group_id"], r["state"], r["action"], r["next_state"]) for r in recs]
    for k, a in zip(key, episode, strict=True):
        pools[k].append(a)
    return [_mean(pools[k]) for k in key]


def ref_graphgpo(steps: pl.DataFrame, w: float) -> list[float]:
    recs = _records(steps)
    episode = ref_grpo(steps)
    step_return: dict[tuple[str, int], float] = {}
    has_success: dict[str, bool] = {}
    for group_id in dict.fromkeys(r["group_id"] for r in recs):
        rows = [r for r in recs if r["group_id"] == group_id]
        predecessors: dict[str, set[str]] = defaultdict(set)
        for r in rows:
            predecessors[r["next_state"]].add(r["state"])
        goals = [r["next_state"] for r in rows if r["done"] and r["outcome"] > 0]
        has_success[group_id] = bool(goals)
        # Breadth-first search backwards from the successful ends.
        dist: dict[str, int] = {}
        queue: deque[str] = deque()
        for g in goals:
            if g not in dist:
                dist[g] = 0
                queue.append(g)
        while queue:
            v = queue.popleft()
            for u in sorted(predecessors[v]):
                if u not in dist:
                    dist[u] = dist[v] + 1
                    queue.append(u)
        unreachable = max(dist.values()) + 1 if dist else 0
        for r in rows:
            step_return[(r["traj_id"], r["step"])] = 10.0 * w ** dist.get(r["next_state"], unreachable)
    x = [step_return[(r["traj_id"], r["step"])] for r in recs]
    normalized = _step_norm(recs, x)
    return [
        e + (s if has_success[r["group_id"]] else 0.0)
        for r, e, s in zip(recs, episode, normalized, strict=True)
    ]


def ref_rtmc(steps: pl.DataFrame, gamma: float) -> list[float]:
    recs = _records(steps)
    ret = ref_return_to_go(steps, gamma, outcome_at_end_node=True)
    q_pool: dict[tuple, list[float]] = defaultdict(list)
    v_pool: dict[tuple, list[float]] = defaultdict(list)
    for r, g in zip(recs, ret, strict=True):
        q_pool[(r["group_id"], r["state"], r["action"])].append(g)
        v_pool[(r["group_id"], r["state"])].append(g)
    return [
        _mean(q_pool[(r["group_id"], r["state"], r["action"])]) - _mean(v_pool[(r["group_id"], r["state"])])
        for r in recs
    ]
