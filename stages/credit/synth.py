"""Synthetic group rollouts from random sparse-reward MDPs with a known stochastic policy.

The fixture for tests and benchmarks of the credit stages: every group is one random MDP; its
``group_size`` rollouts sample the same MDP with the same policy, so their trajectory graph, values and
advantages can be compared with exact answers.

The underlying MDP of a group
-----------------------------
Positions ``(l, p)``: layer ``l in 0..H`` (H = ``horizon``, the max turns) and ``p in 0..width-1``;
every episode starts at ``(0, 0)``. Each position has ``actions`` valid actions and one invalid
pseudo-action. The policy is

    pi(invalid | s) = invalid_rate,   pi(a_k | s) = (1 - invalid_rate) * w_k,   w ~ Dirichlet(1).

Transitions are deterministic per (s, a). A valid action at layer ``l < H-1`` ends the episode with
probability ``end_rate`` (drawn once per edge of the MDP): at the group's goal (share ``goal_share``,
outcome ``success_reward``) or at its fail state (outcome 0). Otherwise it moves to a random position
of layer ``l + 1`` -- or, with probability ``cycles``, back to a random earlier position (layer
``<= l``; cyclic mode only). At the last turn (layer ``H - 1``) a valid edge ends the episode with
probability ``1 - truncation``; otherwise the episode is cut at max turns (``truncated``, outcome 0).
Invalid actions keep the position and cost ``invalid_penalty`` (a self-loop: ``next_state == state``).

Step rewards are ``invalid_penalty`` for invalid actions and 0 otherwise (sparse reward); the outcome
is ``success_reward`` when the trajectory ended at the goal, else 0.

State keys and merging
----------------------
A fraction ``merge`` of positions are *hubs* (plus the start and every back-edge target). A hub's key
is canonical, ``g3/L2/s1``, so every trajectory that reaches it shares the node. A non-hub key also
carries a hash of the valid moves since the last hub, ``g3/L2/s1/h8812``: trajectories only share it
when they took the same path (a tree), so ``merge`` sets how often diverged rollouts meet again.
Keys differ only in naming -- the dynamics and values depend on ``(l, p)`` alone.

``truth=True``: layered mode
----------------------------
The layer of a state is its turn index (``l = t``), so the MDP is acyclic with a finite horizon: an
invalid action moves to the same position of the next layer, ``cycles`` makes a valid edge keep its
position (there is no "back" in time). Values are exact by backward induction over layers, with the
graph stage's convention that an episode's end carries its outcome as a terminal value:

    V(l, p) = sum_a pi(a | s) Q(l, p, a)
    Q(l, p, a) = r(s, a) + gamma * { success_reward (goal) | 0 (fail) | V(l + 1, p') (continue) }
    V(H, .) = 0   (cut at max turns: a truncated end is a failure)

and ``A = Q - V``.

Shapes: G groups, L = H + 1 layers, W = width, K = actions (+1 invalid at index K).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from schemas import conform, write_table
from schemas.errors import GraftError

# Kinds of a valid edge.
CONTINUE, GOAL, FAIL = 0, 1, 2
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class SynthMDPs:
    """One random MDP per group (arrays indexed [group, layer, position(, action)]).

    policy:      (G, L, W, K+1) float64, pi(a | s); column K is the invalid action
    kind:        (G, L, W, K) int8, CONTINUE / GOAL / FAIL of each valid edge
    next_layer:  (G, L, W, K) int32, destination layer of each continuing valid edge
    next_pos:    (G, L, W, K) int32, destination position of each continuing valid edge
    hub:         (G, L, W) bool, the position has a canonical (history-free) key
    layered:     True in truth mode (layer == turn index; acyclic)
    """

    policy: np.ndarray
    kind: np.ndarray
    next_layer: np.ndarray
    next_pos: np.ndarray
    hub: np.ndarray
    layered: bool
    horizon: int
    invalid_penalty: float
    success_reward: float

    @property
    def groups(self) -> int:
        return self.policy.shape[0]

    @property
    def actions(self) -> int:
        return self.kind.shape[3]


def _check_knobs(**knobs: float) -> None:
    for name in ("groups", "group_size", "horizon", "width", "actions"):
        if int(knobs[name]) < 1:
            raise GraftError(f"synth: {name} must be >= 1, got {knobs[name]}")
    for name in ("merge", "cycles", "invalid_rate", "truncation", "end_rate", "goal_share"):
        if not 0.0 <= float(knobs[name]) <= 1.0:
            raise GraftError(f"synth: {name} must be in [0, 1], got {knobs[name]}")
    if int(knobs["seed"]) < 0:  # SeedSequence entropy is non-negative
        raise GraftError(f"synth: seed must be >= 0, got {knobs['seed']}")
    if not 0.0 < float(knobs["gamma"]) <= 1.0:
        raise GraftError(f"synth: gamma must be in (0, 1], got {knobs['gamma']}")
    for name in ("invalid_penalty", "success_reward"):
        if not np.isfinite(float(knobs[name])):
            raise GraftError(f"synth: {name} must be finite, got {knobs[name]}")


def make_mdps(
    groups: int = 8,
    horizon: int = 8,
    width: int = 4,
    merge: float = 0.5,
    cycles: float = 0.1,
    invalid_rate: float = 0.1,
    invalid_penalty: float = -0.1,
    truncation: float = 0.1,
    success_reward: float = 1.0,
    actions: int = 3,
    end_rate: float = 0.2,
    goal_share: float = 0.5,
    layered: bool = False,
    rng: np.random.Generator | None = None,
) -> SynthMDPs:
    """Draw one random MDP and policy per group (see the module docstring for the model)."""
    rng = rng if rng is not None else np.random.default_rng(0)
    G, H, W, K = groups, horizon, width, actions
    L = H + 1
    weights = rng.gamma(1.0, size=(G, L, W, K))
    weights /= weights.sum(axis=-1, keepdims=True)
    policy = np.empty((G, L, W, K + 1))
    policy[..., :K] = weights * (1.0 - invalid_rate)
    policy[..., K] = invalid_rate

    layer = np.arange(L, dtype=np.int32)[None, :, None, None]
    ends = rng.random((G, L, W, K)) < end_rate
    ends[:, H - 1 :] = rng.random((G, L - (H - 1), W, K)) >= truncation
    if not layered:
        ends[:, H] = True  # layer H is only reachable in cyclic mode; every valid edge there ends
    goal = rng.random((G, L, W, K)) < goal_share
    kind = np.where(ends, np.where(goal, GOAL, FAIL), CONTINUE).astype(np.int8)

    next_pos = rng.integers(0, W, size=(G, L, W, K), dtype=np.int32)
    next_layer = np.broadcast_to(np.minimum(layer + 1, H), (G, L, W, K)).astype(np.int32)
    cycle = rng.random((G, L, W, K)) < cycles
    back_layer = np.floor(rng.random((G, L, W, K)) * (layer + 1)).astype(np.int32)
    hub = rng.random((G, L, W)) < merge
    hub[:, 0, 0] = True
    if layered:
        # No way back in time: a "cycle" keeps the position for the next turn.
        position = np.arange(W, dtype=np.int32)[None, None, :, None]
        next_pos = np.where(cycle, position, next_pos).astype(np.int32)
    else:
        back = cycle & (kind == CONTINUE)
        next_layer = np.where(back, back_layer, next_layer).astype(np.int32)
        g_idx = np.broadcast_to(np.arange(G)[:, None, None, None], back.shape)
        hub[g_idx[back], next_layer[back], next_pos[back]] = True  # a revisit is to a shared state
    return SynthMDPs(
        policy=policy,
        kind=kind,
        next_layer=next_layer,
        next_pos=next_pos,
        hub=hub,
        layered=layered,
        horizon=H,
        invalid_penalty=float(invalid_penalty),
        success_reward=float(success_reward),
    )


def exact_values(mdps: SynthMDPs, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Backward induction on layered MDPs: V (G, L, W) and Q (G, L, W, K+1), see module docstring."""
    if not mdps.layered:
        raise GraftError("synth: exact values need the layered (truth=True) MDPs")
    G, L, W, K1 = mdps.policy.shape
    K = K1 - 1
    H = mdps.horizon
    V = np.zeros((G, L, W))
    Q = np.zeros((G, L, W, K1))
    terminal = np.where(mdps.kind == GOAL, mdps.success_reward, 0.0)
    for layer in range(H - 1, -1, -1):
        after = V[:, layer + 1]  # (G, W)
        cont = np.take_along_axis(after, mdps.next_pos[:, layer].reshape(G, W * K), axis=1).reshape(G, W, K)
        kind = mdps.kind[:, layer]
        Q[:, layer, :, :K] = gamma * np.where(kind == CONTINUE, cont, terminal[:, layer])
        Q[:, layer, :, K] = mdps.invalid_penalty + gamma * after  # invalid: same position, next layer
        V[:, layer] = (mdps.policy[:, layer] * Q[:, layer]).sum(axis=-1)
    return V, Q


def continuation_returns(
    mdps: SynthMDPs,
    group: np.ndarray,
    layer: np.ndarray,
    pos: np.ndarray,
    k: int,
    gamma: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Returns of ``k`` episodes of the policy from each start ``(group[i], layer[i], pos[i])`` of the
    layered MDPs (shape (n, k)): ``G = Σ_j γ^j r_j + γ^n R`` with the sampler's dynamics, the Monte-Carlo
    counterpart of ``exact_values`` (its mean over k is an unbiased estimate of V(l, p))."""
    if not mdps.layered:
        raise GraftError("synth: continuations need the layered (truth=True) MDPs (layer = turn)")
    K = mdps.actions
    g = np.repeat(np.asarray(group, np.int64), k)
    lay = np.repeat(np.asarray(layer, np.int64), k)
    p = np.repeat(np.asarray(pos, np.int64), k)
    ret = np.zeros(g.size)
    disc = np.ones(g.size)
    alive = lay < mdps.horizon
    cum = np.cumsum(mdps.policy, axis=-1)
    while (idx := np.flatnonzero(alive)).size:
        gi, li, pi = g[idx], lay[idx], p[idx]
        c = cum[gi, li, pi]
        u = rng.random(idx.size) * c[:, -1]
        a = np.minimum((u[:, None] >= c).sum(axis=1), K)
        invalid = a == K
        av = np.minimum(a, K - 1)
        kind = np.where(invalid, CONTINUE, mdps.kind[gi, li, pi, av])
        ret[idx] += disc[idx] * np.where(invalid, mdps.invalid_penalty, 0.0)
        disc[idx] *= gamma
        ret[idx] += disc[idx] * np.where(kind == GOAL, mdps.success_reward, 0.0)
        nl = np.where(invalid, li + 1, mdps.next_layer[gi, li, pi, av])
        npos = np.where(invalid, pi, mdps.next_pos[gi, li, pi, av])
        lay[idx], p[idx] = nl, npos
        alive[idx] = (kind == CONTINUE) & (nl < mdps.horizon)  # V(H, .) = 0: a cut episode fails
    return ret.reshape(-1, k)


@dataclass(frozen=True)
class _Rollouts:
    """Flat per-row arrays of sampled rollouts (rows ordered by trajectory, then step)."""

    group: np.ndarray
    rollout: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    pos: np.ndarray
    key_hash: np.ndarray
    action: np.ndarray
    next_kind: np.ndarray  # CONTINUE (a state) / GOAL / FAIL
    next_layer: np.ndarray
    next_pos: np.ndarray
    next_key_hash: np.ndarray
    done: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    success: np.ndarray


def _mix(h: np.ndarray, layer: np.ndarray, pos: np.ndarray, action: np.ndarray) -> np.ndarray:
    code = (layer.astype(np.uint64) << np.uint64(40)) ^ (pos.astype(np.uint64) << np.uint64(8))
    code ^= action.astype(np.uint64) + np.uint64(1)
    return (h ^ code) * _HASH_MULT + np.uint64(0x632BE59BD9B4E019)


def _sample(mdps: SynthMDPs, group_size: int, rng: np.random.Generator) -> _Rollouts:
    G, H = mdps.groups, mdps.horizon
    K = mdps.actions
    M = G * group_size
    group = np.repeat(np.arange(G, dtype=np.int64), group_size)
    layer = np.zeros(M, dtype=np.int32)
    pos = np.zeros(M, dtype=np.int32)
    h = np.zeros(M, dtype=np.uint64)
    alive = np.ones(M, dtype=bool)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in _Rollouts.__dataclass_fields__}
    cum = np.cumsum(mdps.policy, axis=-1)
    for t in range(H):
        idx = np.flatnonzero(alive)
        if idx.size == 0:
            break
        g, lay, p, hh = group[idx], layer[idx], pos[idx], h[idx]
        c = cum[g, lay, p]  # (n, K+1)
        u = rng.random(idx.size) * c[:, -1]
        a = np.minimum((u[:, None] >= c).sum(axis=1), K).astype(np.int32)
        invalid = a == K
        av = np.minimum(a, K - 1)
        kind = np.where(invalid, CONTINUE, mdps.kind[g, lay, p, av]).astype(np.int8)
        nl = np.where(invalid, lay + 1 if mdps.layered else lay, mdps.next_layer[g, lay, p, av])
        nl = nl.astype(np.int32)
        npos = np.where(invalid, p, mdps.next_pos[g, lay, p, av]).astype(np.int32)
        moved = ~invalid & (kind == CONTINUE)
        nh = np.where(moved, _mix(hh, nl, npos, a), hh)
        nh = np.where(moved & mdps.hub[g, nl, npos], np.uint64(0), nh)
        terminated = kind != CONTINUE
        truncated = ~terminated & (t == H - 1)
        done = terminated | truncated
        for name, value in (
            ("group", g), ("rollout", idx % group_size), ("step", np.full(idx.size, t, np.int32)),
            ("layer", lay), ("pos", p), ("key_hash", hh), ("action", a), ("next_kind", kind),
            ("next_layer", nl), ("next_pos", npos), ("next_key_hash", nh), ("done", done),
            ("terminated", terminated), ("truncated", truncated), ("success", kind == GOAL),
        ):  # fmt: skip
            cols[name].append(value)
        layer[idx], pos[idx], h[idx] = nl, npos, nh
        alive[idx[done]] = False
    flat = {k: np.concatenate(v) for k, v in cols.items()}
    # Rows were produced turn by turn; order them by trajectory, then step.
    order = np.lexsort((flat["step"], flat["rollout"], flat["group"]))
    flat = {k: v[order] for k, v in flat.items()}
    # outcome is a property of the whole trajectory: broadcast its last row's success to its rows.
    traj = flat["group"] * group_size + flat["rollout"]
    success_of_traj = np.zeros(M, dtype=bool)
    success_of_traj[traj[flat["done"]]] = flat["success"][flat["done"]]
    flat["success"] = success_of_traj[traj]
    return _Rollouts(**flat)


def _state_keys(
    group: np.ndarray, layer: np.ndarray, pos: np.ndarray, key_hash: np.ndarray, hub: np.ndarray
) -> pl.Series:
    """``g{group}/L{layer}/s{pos}``, plus ``/h{hash}`` off the hubs (see the module docstring)."""
    # Short, readable hashes: the top 36 bits are plenty to tell paths apart within a group.
    short = (key_hash >> np.uint64(28)).astype(np.int64)
    frame = pl.DataFrame({"g": group, "l": layer, "p": pos, "h": short, "plain": hub | (short == 0)})
    return frame.select(
        pl.concat_str(
            pl.lit("g"),
            pl.col("g").cast(pl.String),
            pl.lit("/L"),
            pl.col("l").cast(pl.String),
            pl.lit("/s"),
            pl.col("p").cast(pl.String),
            pl.when(~pl.col("plain")).then(pl.concat_str(pl.lit("/h"), pl.col("h").cast(pl.String))),
            ignore_nulls=True,
        )  # fmt: skip
    ).to_series()


def _steps_frame(mdps: SynthMDPs, r: _Rollouts, group_size: int) -> pl.DataFrame:
    """Assemble the steps table. Strings are built once per group / trajectory / row and gathered."""
    K = mdps.actions
    G = mdps.groups
    traj = r.group * group_size + r.rollout
    group_ids = pl.Series([f"g{g}" for g in range(G)])
    task_ids = pl.Series([f"synth-{g}" for g in range(G)])
    task_types = pl.Series([f"type{g % 3}" for g in range(G)])
    traj_ids = pl.Series([f"g{t // group_size}/r{t % group_size}" for t in range(G * group_size)])
    actions = pl.Series([f"a{k}" for k in range(K)] + ["invalid"])
    state = _state_keys(r.group, r.layer, r.pos, r.key_hash, mdps.hub[r.group, r.layer, r.pos])
    # next_state of a row is the state of the trajectory's next row; only last rows need their own key
    last = np.flatnonzero(r.done)
    next_state = state.shift(-1).scatter(
        last,
        _state_keys(
            r.group[last], r.next_layer[last], r.next_pos[last], r.next_key_hash[last],
            mdps.hub[r.group[last], r.next_layer[last], r.next_pos[last]],
        ),
    )  # fmt: skip
    terminal = {GOAL: "goal", FAIL: "fail"}
    for kind, name in terminal.items():
        rows = last[r.next_kind[last] == kind]
        next_state = next_state.scatter(
            rows, pl.Series([f"g{g}/{name}" for g in r.group[rows]], dtype=pl.String)
        )
    invalid = r.action == K
    out = pl.DataFrame(
        {
            "iter": np.zeros(r.group.size, dtype=np.int32),
            "group_id": group_ids.gather(r.group),
            "task_id": task_ids.gather(r.group),
            "task_type": task_types.gather(r.group),
            "traj_id": traj_ids.gather(traj),
            "step": r.step.astype(np.int32),
            "state": state,
            "next_state": next_state,
            "observation": state,  # the agent sees its state key
            "action": actions.gather(r.action),
            "valid": ~invalid,
            "reward": np.where(invalid, mdps.invalid_penalty, 0.0),
            "outcome": np.where(r.success, mdps.success_reward, 0.0),
            "done": r.done,
            "terminated": r.terminated,
            "truncated": r.truncated,
        }
    )
    # conform adds the (null) policy columns and checks every type against the schema.
    return pl.from_arrow(conform(out, "steps", source="synth"))  # type: ignore[return-value]


def synth_steps(
    groups: int = 8,
    group_size: int = 8,
    horizon: int = 8,
    width: int = 4,
    merge: float = 0.5,
    cycles: float = 0.1,
    invalid_rate: float = 0.1,
    invalid_penalty: float = -0.1,
    truncation: float = 0.1,
    gamma: float = 1.0,
    success_reward: float = 1.0,
    seed: int = 0,
    truth: bool = False,
    *,
    actions: int = 3,
    end_rate: float = 0.2,
    goal_share: float = 0.5,
) -> pl.DataFrame | tuple[pl.DataFrame, pl.DataFrame]:
    """Sample ``group_size`` rollouts of ``groups`` random MDPs as a steps table (schemas STEPS).

    Returns the steps table (``iter`` 0, policy columns null, rows ordered by trajectory and step), and
    with ``truth=True`` (layered, acyclic MDPs) also the ``truth`` table, row-aligned with it:
    ``v_true = V^pi(s_t)``, ``q_true = Q^pi(s_t, a_t)``, ``a_true = Q - V`` under discount ``gamma``.
    The MDPs depend only on ``seed`` and the MDP knobs, not on ``group_size``.
    """
    _check_knobs(
        groups=groups, group_size=group_size, horizon=horizon, width=width, actions=actions, merge=merge,
        cycles=cycles, invalid_rate=invalid_rate, truncation=truncation, end_rate=end_rate,
        goal_share=goal_share, gamma=gamma, invalid_penalty=invalid_penalty, success_reward=success_reward,
        seed=seed,
    )  # fmt: skip
    mdps = synth_mdps(
        groups=groups, horizon=horizon, width=width, merge=merge, cycles=cycles, invalid_rate=invalid_rate,
        invalid_penalty=invalid_penalty, truncation=truncation, success_reward=success_reward, seed=seed,
        truth=truth, actions=actions, end_rate=end_rate, goal_share=goal_share,
    )  # fmt: skip
    _, sample_seed = np.random.SeedSequence(seed).spawn(2)  # synth_mdps draws from the first stream
    rollouts = _sample(mdps, group_size, np.random.default_rng(sample_seed))
    steps = _steps_frame(mdps, rollouts, group_size)
    if not truth:
        return steps
    V, Q = exact_values(mdps, gamma)
    v = V[rollouts.group, rollouts.layer, rollouts.pos]
    q = Q[rollouts.group, rollouts.layer, rollouts.pos, rollouts.action]
    truth_table = steps.select("group_id", "traj_id", "step").with_columns(
        v_true=pl.Series(v), q_true=pl.Series(q), a_true=pl.Series(q - v)
    )
    return steps, truth_table


def synth_mdps(
    groups: int = 8,
    horizon: int = 8,
    width: int = 4,
    merge: float = 0.5,
    cycles: float = 0.1,
    invalid_rate: float = 0.1,
    invalid_penalty: float = -0.1,
    truncation: float = 0.1,
    success_reward: float = 1.0,
    seed: int = 0,
    truth: bool = False,
    *,
    actions: int = 3,
    end_rate: float = 0.2,
    goal_share: float = 0.5,
) -> SynthMDPs:
    """The MDPs ``synth_steps`` with the same arguments samples from (for reference computations)."""
    mdp_seed, _ = np.random.SeedSequence(seed).spawn(2)
    return make_mdps(
        groups=groups, horizon=horizon, width=width, merge=merge, cycles=cycles, invalid_rate=invalid_rate,
        invalid_penalty=invalid_penalty, truncation=truncation, success_reward=success_reward,
        actions=actions, end_rate=end_rate, goal_share=goal_share, layered=truth,
        rng=np.random.default_rng(mdp_seed),
    )  # fmt: skip


def write_synth(out_dir: str | Path, **knobs) -> list[Path]:
    """Write ``steps.parquet`` (and ``truth.parquet`` with ``truth=True``) into ``out_dir``."""
    out = Path(out_dir)
    result = synth_steps(**knobs)
    if isinstance(result, tuple):
        steps, truth_table = result
        return [
            write_table(steps, "steps", out / "steps.parquet"),
            write_table(truth_table, "truth", out / "truth.parquet"),
        ]
    return [write_table(result, "steps", out / "steps.parquet")]
