"""stages/credit/synth.py: valid steps tables, the knobs do what they say, and exact truth values.

The truth check enumerates every trajectory of small layered MDPs with its probability (a recursion
written here from the model description, not the module's backward induction) and compares the
conditional expected returns V^pi(s_t) = E[G_t | s_t] and Q^pi(s_t, a_t) = E[G_t | s_t, a_t] with the
truth table, row by row.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import TABLES, read_table, validate_steps
from schemas.errors import GraftError
from stages.credit.synth import FAIL, GOAL, synth_mdps, synth_steps, write_synth

KEY = re.compile(r"^g(\d+)/L(\d+)/s(\d+)(/h\d+)?$")


def _enumerate_values(mdps, group: int, gamma: float) -> tuple[dict, dict]:
    """Brute force over all trajectories of one layered MDP: V[(t, l, p)] and Q[(t, l, p, a)].

    Each trajectory carries its probability and its per-step rewards; the terminal value is the
    outcome (success_reward at the goal, 0 at the fail state or when cut at max turns).
    """
    policy, kind = mdps.policy[group], mdps.kind[group]
    next_layer, next_pos = mdps.next_layer[group], mdps.next_pos[group]
    n_valid = kind.shape[-1]
    H = mdps.horizon
    trajectories: list[tuple[float, list[tuple[int, int, int]], list[float], float]] = []

    def walk(t, layer, pos, prob, path, rewards):
        for a in range(n_valid + 1):
            p_a = policy[layer, pos, a]
            if p_a == 0.0:
                continue
            step = (layer, pos, a)
            if a == n_valid:  # invalid: same position, next layer, penalty
                reward, end, nxt = mdps.invalid_penalty, None, (layer + 1, pos)
            else:
                reward = 0.0
                k = kind[layer, pos, a]
                end = mdps.success_reward if k == GOAL else (0.0 if k == FAIL else None)
                nxt = (next_layer[layer, pos, a], next_pos[layer, pos, a])
            if end is None and t + 1 == H:
                end = 0.0  # cut at max turns
            if end is not None:
                trajectories.append((prob * p_a, [*path, step], [*rewards, reward], end))
            else:
                walk(t + 1, nxt[0], nxt[1], prob * p_a, [*path, step], [*rewards, reward])

    walk(0, 0, 0, 1.0, [], [])
    total = sum(t[0] for t in trajectories)
    assert total == pytest.approx(1.0)
    v_num, v_den, q_num, q_den = (defaultdict(float) for _ in range(4))
    for prob, path, rewards, outcome in trajectories:
        T = len(path)
        for t, (layer, pos, a) in enumerate(path):
            g_t = sum(gamma**k * rewards[t + k] for k in range(T - t)) + gamma ** (T - t) * outcome
            v_num[(t, layer, pos)] += prob * g_t
            v_den[(t, layer, pos)] += prob
            q_num[(t, layer, pos, a)] += prob * g_t
            q_den[(t, layer, pos, a)] += prob
    V = {k: v_num[k] / v_den[k] for k in v_num}
    Q = {k: q_num[k] / q_den[k] for k in q_num}
    return V, Q


@pytest.mark.parametrize(
    ("gamma", "knobs"),
    [
        (1.0, {}),
        (0.9, {"invalid_rate": 0.3, "truncation": 0.5, "merge": 0.0}),
        (0.7, {"width": 2, "cycles": 0.5, "success_reward": 10.0, "invalid_penalty": -1.0}),
    ],
)
def test_truth_equals_brute_force_enumeration(gamma, knobs):
    args = {"groups": 3, "horizon": 4, "width": 3, "seed": 11} | knobs
    steps, truth = synth_steps(group_size=16, gamma=gamma, truth=True, **args)
    mdps = synth_mdps(truth=True, **args)
    n_valid = mdps.actions
    rows = pl.concat([steps.select("state", "action", "group_id"), truth.drop("group_id")], how="horizontal")
    assert rows["traj_id"].to_list() == steps["traj_id"].to_list()
    checked = 0
    for group in range(3):
        V, Q = _enumerate_values(mdps, group, gamma)
        for row in rows.filter(pl.col("group_id") == f"g{group}").iter_rows(named=True):
            g, layer, pos, _ = KEY.match(row["state"]).groups()
            layer, pos = int(layer), int(pos)
            assert int(g) == group and layer == row["step"]  # layered: the layer is the turn
            a = n_valid if row["action"] == "invalid" else int(row["action"][1:])
            assert row["v_true"] == pytest.approx(V[(row["step"], layer, pos)], abs=1e-12)
            assert row["q_true"] == pytest.approx(Q[(row["step"], layer, pos, a)], abs=1e-12)
            assert row["a_true"] == pytest.approx(row["q_true"] - row["v_true"], abs=1e-12)
            checked += 1
    assert checked == steps.height


def test_truth_is_bellman_consistent_along_the_rows():
    """q_true(t) = r_t + gamma * (v_true(t+1), or the outcome at a terminated end, or 0 when cut)."""
    gamma = 0.95
    steps, truth = synth_steps(groups=20, group_size=8, horizon=6, gamma=gamma, truth=True, seed=3)
    df = pl.concat([steps, truth.select("v_true", "q_true")], how="horizontal")
    df = df.with_columns(v_next=pl.col("v_true").shift(-1).over("traj_id"))
    after = (
        pl.when(~pl.col("done"))
        .then(pl.col("v_next"))
        .when(pl.col("terminated"))
        .then(pl.col("outcome"))
        .otherwise(0.0)
    )
    expected = df.select(pl.col("reward") + gamma * after)["reward"].to_numpy()
    np.testing.assert_allclose(df["q_true"].to_numpy(), expected, atol=1e-12)


def test_monte_carlo_return_from_the_start_matches_v_true():
    """Independent of the MDP arrays: the mean discounted return of many rollouts from s_0 -> V(s_0)."""
    gamma = 0.9
    steps, truth = synth_steps(groups=2, group_size=20000, horizon=5, gamma=gamma, truth=True, seed=5)
    df = steps.select("group_id", "traj_id", "step", "reward", "outcome", "done").with_columns(
        truth["v_true"]
    )
    returns = df.group_by("group_id", "traj_id").agg(
        g=(pl.col("reward") * gamma ** pl.col("step")).sum()
        + pl.col("outcome").first() * gamma ** pl.len().cast(pl.Float64),
        v0=pl.col("v_true").first(),
    )
    per_group = returns.group_by("group_id").agg(
        mean=pl.col("g").mean(), sem=pl.col("g").std() / pl.len().sqrt(), v0=pl.col("v0").first()
    )
    for row in per_group.iter_rows(named=True):
        assert abs(row["mean"] - row["v0"]) < 5 * row["sem"] + 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.integers(1, 4),
    group_size=st.integers(1, 6),
    horizon=st.integers(1, 7),
    width=st.integers(1, 5),
    merge=st.floats(0, 1),
    cycles=st.floats(0, 1),
    invalid_rate=st.floats(0, 1),
    truncation=st.floats(0, 1),
    truth=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_knobs_give_a_valid_table(
    groups, group_size, horizon, width, merge, cycles, invalid_rate, truncation, truth, seed
):
    result = synth_steps(
        groups=groups, group_size=group_size, horizon=horizon, width=width, merge=merge, cycles=cycles,
        invalid_rate=invalid_rate, truncation=truncation, truth=truth, seed=seed,
    )  # fmt: skip
    steps = result[0] if truth else result
    validate_steps(steps)
    assert steps["traj_id"].n_unique() == groups * group_size
    assert steps.filter("done").height == groups * group_size
    assert steps["step"].max() < horizon
    for col in ("prompt", "response", "prompt_ids", "response_ids", "response_logprobs", "choices"):
        assert steps[col].null_count() == steps.height
    assert (steps["iter"] == 0).all()
    # invalid rows: the step penalty; in cyclic mode a self-loop, in layered mode the next layer
    invalid = steps.filter(~pl.col("valid"))
    assert (invalid["reward"] == -0.1).all()
    assert (steps.filter("valid")["reward"] == 0.0).all()
    if not truth:
        assert (invalid["state"] == invalid["next_state"]).all()
    else:
        truth_table = result[1]
        assert truth_table.height == steps.height
        assert (
            truth_table.select(pl.col("v_true", "q_true", "a_true").is_finite().all()).row(0) == (True,) * 3
        )
        ends = invalid.filter(~pl.col("done"))
        assert (ends["state"] != ends["next_state"]).all()


def test_outcome_is_success_reward_exactly_when_the_goal_is_reached():
    steps = synth_steps(groups=10, group_size=8, success_reward=10.0, seed=1)
    last = steps.filter("done")
    at_goal = last["next_state"].str.ends_with("/goal")
    assert at_goal.any() and (~at_goal).any()
    assert (last.filter(at_goal)["outcome"] == 10.0).all()
    assert (last.filter(~at_goal)["outcome"] == 0.0).all()
    assert last.filter(at_goal | pl.col("next_state").str.ends_with("/fail"))["terminated"].all()
    assert not last.filter(pl.col("truncated"))["terminated"].any()


def test_knobs_move_the_statistics_the_right_way():
    def share(col, **kw):
        s = synth_steps(groups=40, group_size=8, seed=2, **kw)
        return s.filter("done")[col].mean() if col == "truncated" else (~s["valid"]).mean()

    assert share("invalid", invalid_rate=0.0) == 0.0
    assert share("invalid", invalid_rate=0.5) > share("invalid", invalid_rate=0.1) > 0
    # layered, no invalid actions and no cut edges: nothing is ever truncated
    steps, _ = synth_steps(groups=40, invalid_rate=0.0, truncation=0.0, truth=True, seed=2)
    assert not steps["truncated"].any()
    steps, _ = synth_steps(groups=40, truncation=1.0, end_rate=0.0, truth=True, seed=2)
    assert steps.filter("done")["truncated"].all() and (steps.filter("done")["step"] == 7).all()


def test_merge_zero_without_cycles_is_a_tree_and_merge_one_shares_every_state():
    tree = synth_steps(groups=6, group_size=16, merge=0.0, cycles=0.0, invalid_rate=0.0, seed=4)
    moves = tree.filter(~pl.col("next_state").str.contains("goal|fail"))
    parents = moves.group_by("next_state").agg(pl.struct("state", "action").n_unique().alias("n"))
    assert (parents["n"] == 1).all()  # every state has a single (parent, action): a tree
    shared = synth_steps(groups=6, group_size=16, merge=1.0, width=3, horizon=5, seed=4)
    assert not shared["state"].str.contains("/h").any()
    per_group = shared.group_by("group_id").agg(pl.col("state").n_unique().alias("n"))
    assert (per_group["n"] <= 3 * 5).all()
    # merging makes trajectories meet: more distinct parents per state than in the tree
    multi = shared.group_by("next_state").agg(pl.struct("state", "action").n_unique().alias("n"))
    assert (multi["n"] > 1).any()


def test_cycles_revisit_earlier_states_only_in_cyclic_mode():
    cyclic = synth_steps(groups=10, group_size=16, cycles=0.6, invalid_rate=0.0, seed=9)
    revisits = cyclic.group_by("traj_id").agg((pl.col("state").n_unique() < pl.len()).alias("r"))
    assert revisits["r"].any()
    layered, _ = synth_steps(groups=10, group_size=16, cycles=0.6, truth=True, seed=9)
    layers = layered["state"].str.extract(r"/L(\d+)/", 1).cast(pl.Int32)
    assert (layers == layered["step"]).all()


def test_same_seed_same_table_and_mdps_do_not_depend_on_group_size():
    a = synth_steps(seed=3)
    assert a.equals(synth_steps(seed=3))
    assert not a.equals(synth_steps(seed=4))
    mdps_a, mdps_b = synth_mdps(seed=3), synth_mdps(seed=3)
    np.testing.assert_array_equal(mdps_a.policy, mdps_b.policy)
    small, _ = synth_steps(group_size=2, seed=3, truth=True)
    big, truth_big = synth_steps(group_size=50, seed=3, truth=True)
    # the same state has the same exact value whichever sample reached it
    _, truth_small = synth_steps(group_size=2, seed=3, truth=True)
    v_small = dict(zip(small["state"], truth_small["v_true"], strict=True))
    v_big = dict(zip(big["state"], truth_big["v_true"], strict=True))
    common = set(v_small) & set(v_big)
    assert common and all(v_small[k] == v_big[k] for k in common)


@pytest.mark.parametrize(
    "bad", [{"groups": 0}, {"width": 0}, {"merge": 1.5}, {"gamma": 0.0}, {"invalid_rate": -0.1}, {"seed": -1}]
)
def test_bad_knobs_are_user_errors(bad):
    with pytest.raises(GraftError, match=next(iter(bad))):
        synth_steps(**bad)


def test_write_synth_writes_stamped_tables(tmp_path):
    paths = write_synth(tmp_path / "out", groups=2, truth=True)
    assert [p.name for p in paths] == ["steps.parquet", "truth.parquet"]
    steps = read_table(paths[0], "steps")
    truth = read_table(paths[1], "truth")
    validate_steps(steps)
    assert truth.columns == TABLES["truth"].column_names and truth.height == steps.height
    assert not list((tmp_path / "out").glob("*.tmp"))
