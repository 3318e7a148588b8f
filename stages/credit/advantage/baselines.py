"""Baseline credit estimators (docs/design.md §4 Baselines): grpo, rloo, gigpo, salt, graphgpo, rtmc.

Every estimator is a pure function ``(CreditInputs, AdvantageConfig) -> CreditOutput`` registered by
name. All of them work on the whole table at once: rows are mapped to dense integer codes (group,
trajectory, step group, ...) and the per-group statistics are ``numpy.bincount`` reductions, so the
cost is O(n) array work with no Python loop over rows (the discounted returns loop over the depth
``T - 1 - t`` only, and the graph distances are one ``scipy.sparse.csgraph`` call for all groups).
Results do not depend on the row order of the input and come back row-aligned with ``inputs.steps``.

Shapes: n = rows of ``inputs.steps`` (= rows of ``inputs.edges``); every returned array is (n,).
Units: advantages are in reward units for rloo and rtmc, and in standard deviations for the
normalized estimators (grpo, salt, and the episode/step parts of gigpo and graphgpo).
"""

from __future__ import annotations

import numpy as np
import polars as pl
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import dijkstra

from schemas.config import AdvantageConfig
from schemas.errors import GraftError
from stages.credit.advantage.registry import ESTIMATORS, CreditInputs, CreditOutput, register

# The registered baseline names, in the order docs/design.md §4 lists them.
BASELINES = ("grpo", "rloo", "gigpo", "salt", "graphgpo", "rtmc")
# The normalization epsilon of docs/design.md §4 (std_ddof1 + 1e-6).
NORM_EPS = 1e-6
# GraphGPO's success reward r_succ in r(s, a, s') = r_succ * w^{d(s')} (docs/design.md §4 fixes it at 10).
GRAPHGPO_SUCCESS_REWARD = 10.0


# ----------------------------------------------------------------------------------------------------
# Shared vectorized pieces


def _codes(frame: pl.DataFrame, columns: list[str]) -> np.ndarray:
    """Dense 0-based int64 code per row for the distinct values of ``columns`` (shape (n,))."""
    if frame.height == 0:
        return np.zeros(0, dtype=np.int64)
    ranks = frame.select(pl.struct(columns).rank("dense").alias("code"))["code"]
    return ranks.to_numpy().astype(np.int64) - 1


def _group_sizes(codes: np.ndarray) -> np.ndarray:
    """Rows per code, broadcast back to the rows (shape (n,), int64)."""
    if codes.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.bincount(codes)[codes]


def _group_mean(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Mean of ``x`` over the rows of each code, broadcast back to the rows (shape (n,))."""
    if codes.size == 0:
        return np.zeros(0, dtype=np.float64)
    counts = np.bincount(codes)
    # Codes without rows (e.g. nodes that are only a dst) have count 0; they are never read back.
    return (np.bincount(codes, weights=x) / np.maximum(counts, 1))[codes]


def _normalize_in_groups(
    x: np.ndarray, codes: np.ndarray, divide_std: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``(x - mean_g) / (std_ddof1_g + 1e-6)`` per code g; a code with one row gives 0.

    ``divide_std=False`` only centres: ``x - mean_g`` (verl-agent's ``mean_norm``).
    Returns the normalized values and the group size of every row (both shape (n,)).
    """
    size = _group_sizes(codes)
    if codes.size == 0:
        return np.zeros(0, dtype=np.float64), size
    centered = x - _group_mean(x, codes)
    if not divide_std:
        return np.where(size >= 2, centered, 0.0), size
    sum_sq = np.bincount(codes, weights=centered * centered)[codes]
    # ddof 1; singletons are zeroed below, the max only avoids dividing by zero for them.
    std = np.sqrt(sum_sq / np.maximum(size - 1, 1))
    normalized = np.where(size >= 2, centered / (std + NORM_EPS), 0.0)
    return normalized, size


class _Rows:
    """The columns every baseline needs, as numpy arrays aligned with ``inputs.steps``.

    group:   (n,) int64 dense group code           traj:   (n,) int64 dense trajectory code
    step:    (n,) int64 turn index t                last:   (n,) bool, row is its trajectory's last step
    reward:  (n,) float64 r_t                        outcome: (n,) float64 R of the trajectory
    src/dst: (n,) int64 dense node codes, unique across groups (node ids of the graph's φ)
    n_nodes: number of distinct (group, node) pairs
    """

    def __init__(self, inputs: CreditInputs) -> None:
        steps, edges = inputs.steps, inputs.edges
        _check_aligned(steps, edges)
        self.frame = steps.select("group_id", "traj_id", "step", "action", "reward", "outcome")
        self.n = steps.height
        self.group = _codes(self.frame, ["group_id"])
        self.traj = _codes(self.frame, ["group_id", "traj_id"])
        self.step = steps["step"].to_numpy().astype(np.int64)
        self.reward = steps["reward"].to_numpy().astype(np.float64)
        self.outcome = steps["outcome"].to_numpy().astype(np.float64)
        if self.n:
            length = np.zeros(self.traj.max() + 1, dtype=np.int64)
            np.maximum.at(length, self.traj, self.step + 1)
            self.steps_left = length[self.traj] - 1 - self.step  # H_t = T - 1 - t
        else:
            self.steps_left = np.zeros(0, dtype=np.int64)
        self.last = self.steps_left == 0
        # Node ids are per group; pair them with the group code to make them global.
        ends = pl.DataFrame(
            {
                "group": np.concatenate([self.group, self.group]),
                "node": np.concatenate([edges["src"].to_numpy(), edges["dst"].to_numpy()]).astype(np.int64),
            }
        )
        node_codes = _codes(ends, ["group", "node"])
        self.src, self.dst = node_codes[: self.n], node_codes[self.n :]
        self.n_nodes = int(node_codes.max()) + 1 if self.n else 0
        self.node_group = np.zeros(self.n_nodes, dtype=np.int64)
        self.node_group[node_codes] = ends["group"].to_numpy()

    def codes(self, *columns: str) -> np.ndarray:
        """Dense codes of extra row keys; ``src``/``dst`` refer to the graph nodes."""
        if columns == ("src",):
            return self.src  # node codes are already dense and unique across groups
        nodes = [pl.Series(c, getattr(self, c)) for c in columns if c in ("src", "dst")]
        frame = self.frame.with_columns(pl.Series("group", self.group), *nodes)
        return _codes(frame, ["group", *columns])


def _check_aligned(steps: pl.DataFrame, edges: pl.DataFrame) -> None:
    """The edges table must be row-aligned with the steps table (docs/design.md §3 edges)."""
    if steps.height != edges.height:
        raise GraftError(f"edges has {edges.height} rows but steps has {steps.height}; they must align")
    for column in ("group_id", "traj_id", "step"):
        differs = (steps[column] != edges[column]).fill_null(True)
        if differs.any():
            row = int(differs.arg_max())
            raise GraftError(
                f"edges row {row} is not aligned with steps: {column} "
                f"{edges[column][row]!r} != {steps[column][row]!r}"
            )


def _trajectory_return(rows: _Rows) -> np.ndarray:
    """G_i = Σ_t r_t + R_i of each row's trajectory (shape (n,))."""
    if rows.n == 0:
        return np.zeros(0, dtype=np.float64)
    return np.bincount(rows.traj, weights=rows.reward)[rows.traj] + rows.outcome


def _discounted_return_to_go(rows: _Rows, gamma: float, outcome_at_end_node: bool = False) -> np.ndarray:
    """R_t = Σ_{k=0..H_t} γ^k r'_{t+k} (shape (n,)), with the outcome R placed by one of two conventions:

    ``outcome_at_end_node=False`` (verl-agent/GiGPO): r'_t = r_t + R·[t = T−1], R joins the last reward;
    ``outcome_at_end_node=True`` (the graph's): r'_t = r_t + γR·[t = T−1], R is the value of the end node
    reached after the last step, discounted like γV(dst) in the solve and in the exact Q^π.

    Computed backwards over the depth H_t = T − 1 − t for all trajectories at once: the rows at
    depth h take r' plus γ times the return of their successor row (depth h − 1).
    """
    terminal = gamma * rows.outcome if outcome_at_end_node else rows.outcome
    r_prime = rows.reward + np.where(rows.last, terminal, 0.0)
    ret = r_prime.copy()
    if rows.n == 0:
        return ret
    # Row of (trajectory, t + 1) for every row: sort by (trajectory, step); the successor is next.
    order = np.lexsort((rows.step, rows.traj))
    successor = np.full(rows.n, -1, dtype=np.int64)
    successor[order[:-1]] = order[1:]
    by_depth = np.argsort(rows.steps_left, kind="stable")
    bounds = np.searchsorted(rows.steps_left[by_depth], np.arange(rows.steps_left.max() + 2))
    for h in range(1, len(bounds) - 1):
        at_depth = by_depth[bounds[h] : bounds[h + 1]]
        ret[at_depth] = r_prime[at_depth] + gamma * ret[successor[at_depth]]
    return ret


def _trajectory_table(rows: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """Per trajectory (each counted once, whatever its length): G_i and its group code."""
    n_traj = rows.traj.max() + 1 if rows.n else 0
    traj_return = np.zeros(n_traj)
    traj_return[rows.traj] = _trajectory_return(rows)
    traj_group = np.zeros(n_traj, dtype=np.int64)
    traj_group[rows.traj] = rows.group
    return traj_return, traj_group


def _grpo_episode(rows: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """GRPO's normalized episode advantage per row and the trajectories in its group."""
    z, size = _normalize_in_groups(*_trajectory_table(rows))
    return z[rows.traj], size[rows.traj]


def _centered_episode(rows: _Rows) -> np.ndarray:
    """X^E = G_i − mean_j G_j over the group's trajectories, per row (GRPO before normalization)."""
    traj_return, traj_group = _trajectory_table(rows)
    return (traj_return - _group_mean(traj_return, traj_group))[rows.traj]


def _graphgpo_step_return(rows: _Rows, w: float) -> tuple[np.ndarray, np.ndarray]:
    """GraphGPO's shaped step return 10 · w^{d(dst)} per row, and whether the row's group has a success."""
    success_end = rows.last & (rows.outcome > 0)
    d = _shortest_distance_to(rows, rows.dst[success_end])
    finite = np.isfinite(d)
    max_finite = np.full(rows.group.max() + 1, -1.0)
    np.maximum.at(max_finite, rows.node_group[finite], d[finite])
    # Groups without a success have no finite d (-> d = 0 here); callers zero their step part.
    d = np.where(finite, d, max_finite[rows.node_group] + 1.0)
    has_success = np.zeros(rows.group.max() + 1, dtype=bool)
    has_success[rows.group[success_end]] = True
    return GRAPHGPO_SUCCESS_REWARD * np.power(w, d[rows.dst]), has_success[rows.group]


def _output(advantage: np.ndarray, group_size: np.ndarray) -> CreditOutput:
    return CreditOutput(
        advantage=np.asarray(advantage, dtype=np.float64),
        norm_group_size=np.asarray(group_size, dtype=np.int32),
    )


def _shortest_distance_to(rows: _Rows, targets: np.ndarray) -> np.ndarray:
    """d(v): fewest edges from node v to any node in ``targets`` (inf if none), shape (n_nodes,).

    One multi-source BFS over the reversed graph of all groups (the groups are disconnected
    components of one graph because node codes are unique across groups).
    """
    distance = np.full(rows.n_nodes, np.inf)
    if targets.size == 0:
        return distance
    reverse = coo_matrix((np.ones(rows.n), (rows.dst, rows.src)), shape=(rows.n_nodes, rows.n_nodes)).tocsr()
    return dijkstra(reverse, directed=True, indices=np.unique(targets), unweighted=True, min_only=True)


# ----------------------------------------------------------------------------------------------------
# The estimators


@register("grpo")
def grpo(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """GRPO episode advantage, broadcast to every step of the trajectory.

    G_i = Σ_t r_{i,t} + R_i;   A_{i,t} = (G_i − mean_j G_j) / (std_ddof1_j G_j + 1e-6),
    the statistics over the group's trajectories, each counted once. A one-trajectory group gives 0.
    norm_group_size = trajectories in the group.
    """
    rows = _Rows(inputs)
    advantage, n_traj = _grpo_episode(rows)
    return _output(advantage, n_traj)


@register("rloo")
def rloo(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """REINFORCE leave-one-out: A_{i,t} = G_i − (1/(N−1)) Σ_{j≠i} G_j  (= N/(N−1)·(G_i − mean G)).

    G_i = Σ_t r_{i,t} + R_i, N = trajectories in the group; a one-trajectory group gives 0.
    Unnormalized (reward units). norm_group_size = N.
    """
    rows = _Rows(inputs)
    traj_return, traj_group = _trajectory_table(rows)
    total = np.bincount(traj_group, weights=traj_return)[traj_group]
    count = np.bincount(traj_group)[traj_group]
    others_mean = (total - traj_return) / np.maximum(count - 1, 1)
    advantage = np.where(count >= 2, traj_return - others_mean, 0.0)
    return _output(advantage[rows.traj], count[rows.traj])


@register("gigpo")
def gigpo(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """GiGPO (verl-agent): A = A_episode + ω · A_step.

    G_i = Σ_t r_{i,t} + R_i. Episode statistics (``config.gigpo_cross_steps``):
      True (default, verl-agent's ``compute_mean_std_cross_steps``): mean and std_ddof1 of G over the
        group's *step rows* (each row carries its trajectory's G, so a trajectory of T steps counts T
        times);
      False: over the group's trajectories, each counted once (grpo's statistics).
    R_t = Σ_{k=0..T−1−t} γ^k r'_{t+k},  r'_t = r_t + R·[t = T−1]  (outcome added at the last step),
    γ = ``config.gigpo_gamma`` (0.95), ω = ``config.gigpo_omega`` (1).
    Step groups = rows of the group whose state maps to the same graph node (src, the graph's φ:
    exact or similarity).
    ``config.gigpo_mode`` = "mean_std_norm" (default, verl-agent's ALFWorld script):
      A_episode = (G − mean) / (std_ddof1 + 1e-6),  A_step = (R_t − mean) / (std_ddof1 + 1e-6);
    "mean_norm": A_episode = G − mean,  A_step = R_t − mean (no division).
    A statistics pool of one row (a singleton step group, a one-row group) gives 0.
    norm_group_size = step-group size.
    """
    rows = _Rows(inputs)
    divide = _gigpo_divides(config)
    episode = _gigpo_episode(rows, config.gigpo_cross_steps, divide)
    step_return = _discounted_return_to_go(rows, config.gigpo_gamma)
    step, size = _normalize_in_groups(step_return, rows.codes("src"), divide)
    return _output(episode + config.gigpo_omega * step, size)


def _gigpo_divides(config: AdvantageConfig) -> bool:
    if config.gigpo_mode not in ("mean_std_norm", "mean_norm"):
        raise GraftError(
            f"advantage.gigpo_mode must be 'mean_std_norm' or 'mean_norm', got {config.gigpo_mode!r}"
        )
    return config.gigpo_mode == "mean_std_norm"


def _gigpo_episode(rows: _Rows, cross_steps: bool, divide_std: bool) -> np.ndarray:
    """GiGPO's episode part per row: G normalized over the group's step rows or its trajectories."""
    if cross_steps:
        return _normalize_in_groups(_trajectory_return(rows), rows.group, divide_std)[0]
    traj_return, traj_group = _trajectory_table(rows)
    return _normalize_in_groups(traj_return, traj_group, divide_std)[0][rows.traj]


@register("salt")
def salt(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """SALT: GRPO advantages averaged over identical transitions.

    A_{i,t} = mean{ A^grpo_{j,k} : (src, action, dst)_{j,k} = (src, action, dst)_{i,t} in the group },
    src/dst the graph nodes of s_t, s_{t+1}. Averaging preserves the group's total advantage.
    norm_group_size = rows in the transition group that was averaged.
    """
    rows = _Rows(inputs)
    episode, _ = _grpo_episode(rows)
    transition = rows.codes("src", "action", "dst")
    return _output(_group_mean(episode, transition), _group_sizes(transition))


@register("graphgpo")
def graphgpo(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """GraphGPO: A = A_episode + A_step with distance-shaped step returns.

    d(v) = fewest edges from node v to a successful end of the group's graph; a successful end is the
    end node (dst of the last step) of a trajectory with outcome R > 0 (success defined as R > 0).
    Step return of a row: 10 · w^{d(dst)}, w = ``config.graphgpo_w`` (0.1); a node that reaches no
    successful end takes d = (max finite d in the group) + 1. A group with no success has A_step = 0.
    A_step = (x − mean) / (std_ddof1 + 1e-6) over rows with the same src node (singleton → 0).
    A_episode = grpo. norm_group_size = step-group size.
    """
    rows = _Rows(inputs)
    if rows.n == 0:
        return _output(np.zeros(0), np.zeros(0))
    episode, _ = _grpo_episode(rows)
    step_return, has_success = _graphgpo_step_return(rows, config.graphgpo_w)
    step, size = _normalize_in_groups(step_return, rows.codes("src"))
    return _output(episode + np.where(has_success, step, 0.0), size)


@register("rtmc")
def rtmc(inputs: CreditInputs, config: AdvantageConfig) -> CreditOutput:
    """Return-to-go Monte Carlo: A = Q̂(s, a) − V̂(s).

    G_t = Σ_{k=0..T−1−t} γ^k r_{t+k} + γ^{T−t} R, γ = ``inputs.gamma`` (the solve's): the outcome is the
    value of the end node, as in the graph solve and in the paper's G_t = γ^{T−t} R (App. C), so on a
    graph where no two histories merge rtmc equals graft's TD exactly.
    Q̂(s, a) = mean G over the group's rows at (src node, action); V̂(s) = mean G over rows at src node.
    Unnormalized (reward units). norm_group_size = rows at the src node.
    """
    rows = _Rows(inputs)
    ret = _discounted_return_to_go(rows, inputs.gamma, outcome_at_end_node=True)
    state = rows.codes("src")
    q_hat = _group_mean(ret, rows.codes("src", "action"))
    v_hat = _group_mean(ret, state)
    return _output(q_hat - v_hat, _group_sizes(state))


# ----------------------------------------------------------------------------------------------------
# Credit before normalization (what the estimator-accuracy benchmark compares with A^π)


def unnormalized_credit(name: str, inputs: CreditInputs, config: AdvantageConfig) -> dict[str, np.ndarray]:
    """Each baseline's credit before any normalization, by part, each (n,) and row-aligned.

    ``episode``: trajectory-level credit in reward units --
        grpo, graphgpo: X^E = G_i − mean_j G_j (the paper's R − R̄); gigpo: the same, the mean over
        the group's step rows when ``config.gigpo_cross_steps`` (its default);
        rloo: G_i − mean_{j≠i} G_j;  salt: X^E averaged over identical (src, action, dst) transitions.
    ``step``: step-level credit, centered in its src-node step group --
        gigpo: X^S = R_t − mean_{src} R_t, R_t with γ = ``config.gigpo_gamma`` (the paper's G_t − Ḡ(S_t));
        graphgpo: 10·w^{d(dst)} − its src-group mean (shaped, not in reward units; 0 without a success);
        rtmc: Q̂(s, a) − V̂(s) (already unnormalized).
    The registered estimators are these parts, normalized as their docstrings say (grpo, salt, gigpo,
    graphgpo) or unchanged (rloo, rtmc).
    """
    if name in ("rloo", "rtmc"):
        part = "episode" if name == "rloo" else "step"
        return {part: ESTIMATORS[name](inputs, config).advantage}
    rows = _Rows(inputs)
    if name not in ("grpo", "salt", "gigpo", "graphgpo"):
        raise GraftError(
            f"unnormalized_credit: '{name}' is not a baseline; baselines: {', '.join(BASELINES)}"
        )
    episode = _centered_episode(rows)
    if name == "grpo":
        return {"episode": episode}
    if name == "salt":
        return {"episode": _group_mean(episode, rows.codes("src", "action", "dst"))}
    if name == "gigpo":
        step_return = _discounted_return_to_go(rows, config.gigpo_gamma)
        if config.gigpo_cross_steps:  # centred over the group's step rows, as the estimator does
            episode = _gigpo_episode(rows, True, divide_std=False)
        return {"episode": episode, "step": step_return - _group_mean(step_return, rows.codes("src"))}
    if rows.n == 0:
        return {"episode": episode, "step": np.zeros(0)}
    step_return, has_success = _graphgpo_step_return(rows, config.graphgpo_w)
    centered = step_return - _group_mean(step_return, rows.codes("src"))
    return {"episode": episode, "step": np.where(has_success, centered, 0.0)}
