"""Baseline estimators (docs/design.md §4 Baselines): hand-computed examples, edge cases, properties, and a
comparison with the row-loop references in tests/helpers/baseline_reference.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.config import AdvantageConfig
from schemas.errors import GraftError
from stages.credit.advantage import baselines
from stages.credit.advantage.registry import ESTIMATORS, CreditInputs
from tests.helpers.baseline_reference import (
    Traj,
    build_tables,
    random_groups,
    ref_gigpo,
    ref_graphgpo,
    ref_grpo,
    ref_rloo,
    ref_rtmc,
    ref_salt,
)

EPS = 1e-6
GAMMA = 0.9  # the solve's gamma (used by rtmc)
CFG = AdvantageConfig()  # gigpo_omega = 1, gigpo_gamma = 0.95, graphgpo_w = 0.1
# gigpo with grpo's episode statistics (one value per trajectory) instead of verl-agent's default
# statistics over step rows; the hand examples below that predate the option use it.
PER_TRAJ = AdvantageConfig(gigpo_cross_steps=False)


def run(name: str, steps: pl.DataFrame, edges: pl.DataFrame, config: AdvantageConfig = CFG, gamma=GAMMA):
    return ESTIMATORS[name](CreditInputs(steps, edges, pl.DataFrame(), None, gamma), config)


# Group g1 (three trajectories sharing the start S and the node A):
#   T1: S -x-> A -y-> G        rewards 0, 0     outcome 10
#   T2: S -x-> A -z-> F        rewards 0, -0.1  outcome 0
#   T3: S -w-> F               reward  0        outcome 0
# Group g2 (one trajectory, same state names, must not mix with g1):
#   T4: S -x-> A -y-> G        rewards 0, 0     outcome 10
# Row order: T1t0, T1t1, T2t0, T2t1, T3t0, T4t0, T4t1.
EXAMPLE = {
    "g1": [
        Traj("T1", ["S", "A", "G"], ["x", "y"], [0.0, 0.0], 10.0),
        Traj("T2", ["S", "A", "F"], ["x", "z"], [0.0, -0.1], 0.0),
        Traj("T3", ["S", "F"], ["w"], [0.0], 0.0),
    ],
    "g2": [Traj("T4", ["S", "A", "G"], ["x", "y"], [0.0, 0.0], 10.0)],
}

# grpo on g1: G = [10, -0.1, 0], mean 3.3, deviations [6.7, -3.4, -3.3],
# std_ddof1 = sqrt((6.7² + 3.4² + 3.3²) / 2) = sqrt(33.67).
S_EP = math.sqrt((6.7**2 + 3.4**2 + 3.3**2) / 2) + EPS
GRPO_G1 = [6.7 / S_EP, 6.7 / S_EP, -3.4 / S_EP, -3.4 / S_EP, -3.3 / S_EP]


@pytest.fixture
def example():
    return build_tables(EXAMPLE)


def test_grpo_hand_example(example):
    out = run("grpo", *example)
    np.testing.assert_allclose(out.advantage, GRPO_G1 + [0.0, 0.0], atol=1e-12)
    assert out.norm_group_size.tolist() == [3, 3, 3, 3, 3, 1, 1]
    assert out.advantage.dtype == np.float64 and out.norm_group_size.dtype == np.int32
    assert out.td is None and out.gae is None


def test_rloo_hand_example(example):
    # T1: 10 - (-0.1 + 0)/2 = 10.05;  T2: -0.1 - (10 + 0)/2 = -5.1;  T3: 0 - (10 - 0.1)/2 = -4.95
    out = run("rloo", *example)
    np.testing.assert_allclose(out.advantage, [10.05, 10.05, -5.1, -5.1, -4.95, 0.0, 0.0], atol=1e-12)
    assert out.norm_group_size.tolist() == [3, 3, 3, 3, 3, 1, 1]


def test_gigpo_hand_example(example):
    # r' adds the outcome at the last step; R_t with gamma = 0.95:
    #   T1: t0 = 0 + 0.95*10 = 9.5, t1 = 10;  T2: t0 = 0.95*(-0.1) = -0.095, t1 = -0.1;  T3: t0 = 0.
    # Step group S = {9.5, -0.095, 0}: mean 3.135, deviations [6.365, -3.23, -3.135].
    # Step group A = {10, -0.1}: mean 4.95, deviations [5.05, -5.05], std = 5.05*sqrt(2).
    # g2 has only singleton step groups -> A_step = 0, and one trajectory -> A_episode = 0.
    s_s = math.sqrt((6.365**2 + 3.23**2 + 3.135**2) / 2) + EPS
    s_a = 5.05 * math.sqrt(2) + EPS
    step = [6.365 / s_s, 5.05 / s_a, -3.23 / s_s, -5.05 / s_a, -3.135 / s_s]
    out = run("gigpo", *example, config=PER_TRAJ)
    expected = [e + 1.0 * s for e, s in zip(GRPO_G1, step, strict=True)] + [0.0, 0.0]
    np.testing.assert_allclose(out.advantage, expected, atol=1e-12)
    assert out.norm_group_size.tolist() == [3, 2, 3, 2, 3, 1, 1]

    # omega scales the step part; gigpo_gamma is the step discount.
    half = run("gigpo", *example, config=AdvantageConfig(gigpo_omega=0.5, gigpo_cross_steps=False))
    np.testing.assert_allclose(
        half.advantage, [e + 0.5 * s for e, s in zip(GRPO_G1, step, strict=True)] + [0.0, 0.0], atol=1e-12
    )
    # gamma 1: S = {10, -0.1, 0}: mean 3.3, deviations equal the episode ones.
    flat = run("gigpo", *example, config=AdvantageConfig(gigpo_gamma=1.0, gigpo_cross_steps=False))
    np.testing.assert_allclose(flat.advantage[[0, 2, 4]], 2 * np.array(GRPO_G1)[[0, 2, 4]], atol=1e-12)


# The default gigpo (verl-agent's ALFWorld script: mode mean_std_norm, episode statistics across step
# rows). g1's rows carry G = [10, 10, -0.1, -0.1, 0] (T1 and T2 have two steps, T3 one): mean 19.8/5 =
# 3.96, deviations [6.04, 6.04, -4.06, -4.06, -3.96], std_ddof1 = sqrt((2·6.04² + 2·4.06² + 3.96²)/4).
# g2: one trajectory of two rows, both G = 10 -> deviation 0 -> 0.
ROW_DEV = [6.04, 6.04, -4.06, -4.06, -3.96]
ROW_STD = math.sqrt((2 * 6.04**2 + 2 * 4.06**2 + 3.96**2) / 4) + EPS
STEP_DEV = [6.365, 5.05, -3.23, -5.05, -3.135]  # R_t minus its step-group mean (test above)


def test_gigpo_default_is_verl_agent_alfworld(example):
    assert CFG.gigpo_mode == "mean_std_norm" and CFG.gigpo_cross_steps
    s_s = math.sqrt((6.365**2 + 3.23**2 + 3.135**2) / 2) + EPS
    s_a = 5.05 * math.sqrt(2) + EPS
    step = [STEP_DEV[0] / s_s, STEP_DEV[1] / s_a, STEP_DEV[2] / s_s, STEP_DEV[3] / s_a, STEP_DEV[4] / s_s]
    out = run("gigpo", *example)
    expected = [d / ROW_STD + s for d, s in zip(ROW_DEV, step, strict=True)] + [0.0, 0.0]
    np.testing.assert_allclose(out.advantage, expected, atol=1e-12)
    # It differs from the per-trajectory variant whenever trajectory lengths differ.
    assert not np.allclose(out.advantage, run("gigpo", *example, config=PER_TRAJ).advantage)


def test_gigpo_mean_norm_only_centres(example):
    # mean_norm: A = (G - mean) + ω (R_t - mean), no division by the std.
    rows = run("gigpo", *example, config=AdvantageConfig(gigpo_mode="mean_norm"))
    expected = [d + s for d, s in zip(ROW_DEV, STEP_DEV, strict=True)] + [0.0, 0.0]
    np.testing.assert_allclose(rows.advantage, expected, atol=1e-12)
    # per trajectory: episode deviations from grpo's mean 3.3 (G = [10, -0.1, 0]).
    traj = run("gigpo", *example, config=AdvantageConfig(gigpo_mode="mean_norm", gigpo_cross_steps=False))
    episode = [6.7, 6.7, -3.4, -3.4, -3.3]
    expected = [d + s for d, s in zip(episode, STEP_DEV, strict=True)] + [0.0, 0.0]
    np.testing.assert_allclose(traj.advantage, expected, atol=1e-12)
    with pytest.raises(GraftError, match="gigpo_mode"):
        run("gigpo", *example, config=AdvantageConfig(gigpo_mode="median"))  # type: ignore[arg-type]


def test_gigpo_groups_by_graph_node_not_state_string():
    # T2's second state is spelled differently but the graph (e.g. similarity φ) maps it to node A.
    groups = {"g1": [EXAMPLE["g1"][0], Traj("T2", ["S", "A (again)", "F"], ["x", "z"], [0.0, -0.1], 0.0)]}
    steps, edges = build_tables(groups)
    node_a = edges["dst"][0]
    edges = edges.with_columns(
        src=pl.when(pl.col("traj_id").eq("T2") & pl.col("step").eq(1)).then(node_a).otherwise("src"),
        dst=pl.when(pl.col("traj_id").eq("T2") & pl.col("step").eq(0)).then(node_a).otherwise("dst"),
    ).with_columns(pl.col("src", "dst").cast(pl.Int32))
    out = run("gigpo", steps, edges, config=PER_TRAJ)
    assert out.norm_group_size.tolist() == [2, 2, 2, 2]
    # Episode: G = [10, -0.1] -> ±10.1/2 / (10.1/sqrt2) = ±1/sqrt2 (up to eps); step groups of two
    # are also ±1/sqrt2 each: S = {9.5, -0.095}, A = {10, -0.1}.
    half = 1 / math.sqrt(2)
    np.testing.assert_allclose(out.advantage, [2 * half, 2 * half, -2 * half, -2 * half], atol=1e-6)


def test_salt_hand_example(example):
    # T1t0 and T2t0 share (S, x, A) in g1 -> both get (6.7 - 3.4)/2 / std; the rest are unique.
    # g2 also has (S, x, A) but is another group and keeps its own 0.
    out = run("salt", *example)
    shared = (6.7 - 3.4) / 2 / S_EP
    expected = [shared, 6.7 / S_EP, shared, -3.4 / S_EP, -3.3 / S_EP, 0.0, 0.0]
    np.testing.assert_allclose(out.advantage, expected, atol=1e-12)
    assert out.norm_group_size.tolist() == [2, 1, 2, 1, 1, 1, 1]


def test_graphgpo_hand_example(example):
    # Successful end of g1: G (T1, outcome 10). Distances to it: d(G)=0, d(A)=1, d(S)=2;
    # F reaches no success -> d(F) = max finite d + 1 = 3.
    # Step returns 10 * 0.1^d(dst): T1t0 (dst A) 1, T1t1 (dst G) 10, T2t0 (dst A) 1,
    #   T2t1 (dst F) 0.01, T3t0 (dst F) 0.01.
    # Step group S = {1, 1, 0.01}: mean 0.67, deviations [0.33, 0.33, -0.66].
    # Step group A = {10, 0.01}: mean 5.005, deviations ±4.995, std 4.995*sqrt(2).
    s_s = math.sqrt((0.33**2 + 0.33**2 + 0.66**2) / 2) + EPS
    s_a = 4.995 * math.sqrt(2) + EPS
    step = [0.33 / s_s, 4.995 / s_a, 0.33 / s_s, -4.995 / s_a, -0.66 / s_s]
    out = run("graphgpo", *example)
    expected = [e + s for e, s in zip(GRPO_G1, step, strict=True)] + [0.0, 0.0]
    np.testing.assert_allclose(out.advantage, expected, atol=1e-9)
    assert out.norm_group_size.tolist() == [3, 2, 3, 2, 3, 1, 1]


def test_graphgpo_without_success_is_grpo():
    # Both trajectories fail: A_step = 0, so graphgpo equals the episode advantage.
    # G = [0, -0.1] -> deviations ±0.05, std = 0.1/sqrt(2).
    groups = {
        "g3": [
            Traj("T5", ["S", "A", "F"], ["x", "y"], [0.0, 0.0], 0.0),
            Traj("T6", ["S", "F"], ["z"], [-0.1], 0.0),
        ]
    }
    out = run("graphgpo", *build_tables(groups))
    e = 0.05 / (0.1 / math.sqrt(2) + EPS)
    np.testing.assert_allclose(out.advantage, [e, e, -e], atol=1e-12)


def test_graphgpo_w_changes_shaping():
    # w = 0.5 on the example: returns T1t0 5, T1t1 10, T2t0 5, T2t1 10*0.5^3 = 1.25, T3t0 1.25.
    # S = {5, 5, 1.25}: mean 3.75, deviations [1.25, 1.25, -2.5]; A = {10, 1.25}: ±4.375.
    steps, edges = build_tables(EXAMPLE)
    out = run("graphgpo", steps, edges, config=AdvantageConfig(graphgpo_w=0.5))
    s_s = math.sqrt((1.25**2 * 2 + 2.5**2) / 2) + EPS
    s_a = 4.375 * math.sqrt(2) + EPS
    step = [1.25 / s_s, 4.375 / s_a, 1.25 / s_s, -4.375 / s_a, -2.5 / s_s]
    np.testing.assert_allclose(
        out.advantage[:5], [e + s for e, s in zip(GRPO_G1, step, strict=True)], atol=1e-9
    )


def test_rtmc_hand_example(example):
    # Discounted returns with the solve's gamma 0.9, the outcome being the value of the end node
    # (G_t = Σ γ^k r_{t+k} + γ^{T−t} R):
    #   T1: t1 = 0 + 0.9*10 = 9, t0 = 0.9*9 = 8.1;  T2: t1 = -0.1 + 0.9*0 = -0.1, t0 = 0.9*(-0.1) = -0.09;
    #   T3: t0 = 0.
    # Q(S,x) = (8.1 - 0.09)/2 = 4.005, Q(S,w) = 0, V(S) = (8.1 - 0.09 + 0)/3 = 2.67.
    # Q(A,y) = 9, Q(A,z) = -0.1, V(A) = 4.45.  g2: every state has one row -> 0.
    out = run("rtmc", *example)
    expected = [4.005 - 2.67, 9 - 4.45, 4.005 - 2.67, -0.1 - 4.45, 0 - 2.67, 0.0, 0.0]
    np.testing.assert_allclose(out.advantage, expected, atol=1e-12)
    assert out.norm_group_size.tolist() == [3, 2, 3, 2, 3, 1, 1]


@pytest.mark.parametrize("name", ["grpo", "rloo", "gigpo", "salt", "graphgpo", "rtmc"])
def test_one_trajectory_group_gives_zero(name):
    # One trajectory, no revisits: one trajectory in the episode group, every step group a singleton.
    steps, edges = build_tables(
        {"solo": [Traj("T", ["S", "A", "B", "G"], ["x", "y", "x"], [0.5, -0.1, 0.0], 10.0)]}
    )
    out = run(name, steps, edges)
    np.testing.assert_array_equal(out.advantage, np.zeros(3))


def test_revisits_in_one_trajectory_form_a_step_group():
    # T: S -x-> A -y-> S -z-> G (outcome 10, no step rewards). The episode part is 0 (one trajectory),
    # but S is left twice, so gigpo/rtmc/graphgpo compare those two steps.
    steps, edges = build_tables({"solo": [Traj("T", ["S", "A", "S", "G"], ["x", "y", "z"], [0.0] * 3, 10.0)]})
    # gigpo (gamma 0.95): returns at S are t0 = 0.95^2*10 = 9.025 and t2 = 10 -> ∓1/sqrt(2).
    # rtmc (gamma 0.9, outcome at the end node): t2 = 0.9*10 = 9, t1 = 8.1, t0 = 7.29;
    #   V(S) = (7.29 + 9)/2 = 8.145 -> -0.855, +0.855; A is a singleton -> 0.
    # graphgpo: d(G)=0, d(S)=1, d(A)=2; returns at S: dst A 10*0.1^2 = 0.1, dst G 10 -> ∓1/sqrt(2).
    half = 0.4875 / (0.4875 * math.sqrt(2) + EPS)
    np.testing.assert_allclose(run("gigpo", steps, edges).advantage, [-half, 0, half], atol=1e-12)
    np.testing.assert_allclose(run("rtmc", steps, edges).advantage, [-0.855, 0, 0.855], atol=1e-12)
    np.testing.assert_allclose(run("graphgpo", steps, edges).advantage, [-1, 0, 1] / np.sqrt(2), atol=1e-6)


def test_discounted_return_handles_revisits_and_order():
    # T: S -x-> A -y-> S -x-> G, rewards [0.5, -0.1, 0], outcome 10, gamma 0.5:
    # t2 = 10, t1 = -0.1 + 0.5*10 = 4.9, t0 = 0.5 + 0.5*4.9 = 2.95.
    steps, edges = build_tables(
        {"g": [Traj("T", ["S", "A", "S", "G"], ["x", "y", "x"], [0.5, -0.1, 0.0], 10.0)]}, shuffle_seed=3
    )
    rows = baselines._Rows(CreditInputs(steps, edges, pl.DataFrame(), None, 0.5))
    ret = baselines._discounted_return_to_go(rows, 0.5)
    by_step = dict(zip(steps["step"].to_list(), ret.tolist(), strict=True))
    assert by_step == pytest.approx({0: 2.95, 1: 4.9, 2: 10.0}, abs=1e-12)
    # Outcome at the end node: t2 = 0.5*10 = 5, t1 = -0.1 + 0.5*5 = 2.4, t0 = 0.5 + 0.5*2.4 = 1.7.
    ret = baselines._discounted_return_to_go(rows, 0.5, outcome_at_end_node=True)
    by_step = dict(zip(steps["step"].to_list(), ret.tolist(), strict=True))
    assert by_step == pytest.approx({0: 1.7, 1: 2.4, 2: 5.0}, abs=1e-12)


def test_misaligned_edges_are_refused(example):
    steps, edges = example
    with pytest.raises(GraftError, match="edges row 0 is not aligned with steps: step 1 != 0"):
        run("grpo", steps, edges[[1, 0, 2, 3, 4, 5, 6]])
    with pytest.raises(GraftError, match="edges row 0 is not aligned with steps: group_id 'g2' != 'g1'"):
        run("grpo", steps, edges.reverse())
    with pytest.raises(GraftError, match="rows"):
        run("grpo", steps, edges.head(3))


@pytest.mark.parametrize("name", ["grpo", "rloo", "gigpo", "salt", "graphgpo", "rtmc"])
def test_empty_table(name, example):
    steps, edges = example
    out = run(name, steps.head(0), edges.head(0))
    assert out.advantage.shape == (0,) and out.norm_group_size.shape == (0,)


# ----------------------------------------------------------------------------------------------------
# Properties on random tables (rows shuffled)

SEEDS = st.integers(min_value=0, max_value=2**31 - 1)


def _random_tables(seed: int):
    return build_tables(random_groups(seed), shuffle_seed=seed)


def _one_row_per_traj(steps: pl.DataFrame, values: np.ndarray) -> pl.DataFrame:
    return (
        steps.select("group_id", "traj_id")
        .with_columns(v=values)
        .unique("traj_id", keep="first", maintain_order=True)
    )


@settings(max_examples=40, deadline=None)
@given(SEEDS)
def test_grpo_sums_to_zero_over_trajectories(seed):
    steps, edges = _random_tables(seed)
    per_traj = _one_row_per_traj(steps, run("grpo", steps, edges).advantage)
    returns = _one_row_per_traj(steps, np.asarray(ref_grpo(steps)))  # only for the group sizes
    for (group_id,), frame in per_traj.group_by("group_id"):
        total = frame["v"].sum()
        assert abs(total) < 1e-9, (group_id, total)
    assert per_traj.height == returns.height


@settings(max_examples=40, deadline=None)
@given(SEEDS)
def test_rloo_is_scaled_centering(seed):
    # A = G - mean_{j≠i} G_j = N/(N-1) (G - mean G).
    steps, edges = _random_tables(seed)
    out = run("rloo", steps, edges)
    g = (pl.col("reward").sum().over("traj_id") + pl.col("outcome")).alias("G")
    frame = steps.with_columns(g).with_columns(
        n=pl.col("traj_id").n_unique().over("group_id"),
    )
    traj_mean = frame.unique("traj_id").group_by("group_id").agg(mean=pl.col("G").mean())
    frame = frame.join(traj_mean, on="group_id", how="left", maintain_order="left")
    n = frame["n"].to_numpy()
    expected = np.where(n > 1, n / np.maximum(n - 1, 1) * (frame["G"] - frame["mean"]).to_numpy(), 0.0)
    np.testing.assert_allclose(out.advantage, expected, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(SEEDS)
def test_salt_preserves_group_total(seed):
    steps, edges = _random_tables(seed)
    grpo, salt = run("grpo", steps, edges).advantage, run("salt", steps, edges).advantage
    totals = (
        steps.select("group_id").with_columns(g=grpo, s=salt).group_by("group_id").agg(pl.col("g", "s").sum())
    )
    np.testing.assert_allclose(totals["s"], totals["g"], atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(SEEDS)
def test_rtmc_and_step_parts_are_centered_per_state(seed):
    steps, edges = _random_tables(seed)
    state = steps.select("group_id").with_columns(src=edges["src"])
    rtmc = run("rtmc", steps, edges).advantage
    gigpo_step = run("gigpo", steps, edges, config=PER_TRAJ).advantage - run("grpo", steps, edges).advantage
    sums = state.with_columns(r=rtmc, s=gigpo_step).group_by("group_id", "src").agg(pl.col("r", "s").sum())
    np.testing.assert_allclose(sums["r"], 0.0, atol=1e-9)
    np.testing.assert_allclose(sums["s"], 0.0, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(SEEDS)
def test_graphgpo_step_to_a_successful_end_is_best_in_its_group(seed):
    steps, edges = _random_tables(seed)
    step = run("graphgpo", steps, edges).advantage - run("grpo", steps, edges).advantage
    frame = steps.select("group_id", "done", "outcome").with_columns(
        src=edges["src"], dst=edges["dst"], a=step
    )
    goals = frame.filter(pl.col("done") & (pl.col("outcome") > 0)).select("group_id", dst="dst").unique()
    hits = frame.join(goals, on=["group_id", "dst"], how="semi")
    best = frame.group_by("group_id", "src").agg(top=pl.col("a").max())
    joined = hits.join(best, on=["group_id", "src"])
    np.testing.assert_allclose(joined["a"], joined["top"], atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(SEEDS, st.floats(0.5, 1.0), st.floats(0.05, 0.9))
def test_all_baselines_match_the_loop_references(seed, gamma, w):
    steps, edges = _random_tables(seed)
    config = AdvantageConfig(gigpo_gamma=gamma, graphgpo_w=w, gigpo_omega=0.7)
    for cross, mode in [(False, "mean_std_norm"), (True, "mean_norm"), (False, "mean_norm")]:
        variant = dataclasses.replace(config, gigpo_cross_steps=cross, gigpo_mode=mode)
        out = run("gigpo", steps, edges, config=variant, gamma=gamma)
        reference = ref_gigpo(steps, omega=0.7, gamma=gamma, cross_steps=cross, mode=mode)
        np.testing.assert_allclose(out.advantage, reference, atol=1e-9, err_msg=f"gigpo {cross} {mode}")
    expected = {
        "grpo": ref_grpo(steps),
        "rloo": ref_rloo(steps),
        "gigpo": ref_gigpo(steps, omega=0.7, gamma=gamma, cross_steps=True),
        "salt": ref_salt(steps),
        "graphgpo": ref_graphgpo(steps, w=w),
        "rtmc": ref_rtmc(steps, gamma=gamma),
    }
    for name, reference in expected.items():
        out = run(name, steps, edges, config=config, gamma=gamma)
        np.testing.assert_allclose(out.advantage, reference, atol=1e-9, err_msg=name)


def test_deterministic_and_row_order_invariant():
    groups = random_groups(7)
    steps, edges = build_tables(groups)
    shuffled_steps, shuffled_edges = build_tables(groups, shuffle_seed=11)
    for name in ["grpo", "rloo", "gigpo", "salt", "graphgpo", "rtmc"]:
        a = run(name, steps, edges).advantage
        b = run(name, steps, edges).advantage
        np.testing.assert_array_equal(a, b)
        keyed = steps.select("traj_id", "step").with_columns(a=a)
        other = shuffled_steps.select("traj_id", "step").with_columns(
            b=run(name, shuffled_steps, shuffled_edges).advantage
        )
        joined = keyed.join(other, on=["traj_id", "step"])
        np.testing.assert_allclose(joined["a"], joined["b"], atol=1e-12, err_msg=name)


def test_unnormalized_credit_hand_example(example):
    # X^E on g1 = G - 3.3 = [6.7, -3.4, -3.3]; g2 has one trajectory -> 0.
    steps, edges = example
    inputs = CreditInputs(steps, edges, pl.DataFrame(), None, GAMMA)
    x_e = [6.7, 6.7, -3.4, -3.4, -3.3, 0.0, 0.0]
    np.testing.assert_allclose(baselines.unnormalized_credit("grpo", inputs, CFG)["episode"], x_e, atol=1e-12)
    # salt: (S, x, A) shared by T1t0 and T2t0 -> (6.7 - 3.4)/2 = 1.65.
    np.testing.assert_allclose(
        baselines.unnormalized_credit("salt", inputs, CFG)["episode"],
        [1.65, 6.7, 1.65, -3.4, -3.3, 0.0, 0.0],
        atol=1e-12,
    )
    # gigpo step part X^S = R_t - mean over the src node (gamma 0.95, see test_gigpo_hand_example).
    gigpo = baselines.unnormalized_credit("gigpo", inputs, PER_TRAJ)
    np.testing.assert_allclose(gigpo["episode"], x_e, atol=1e-12)
    # default: centred over step rows (ROW_DEV); g2's one trajectory -> 0.
    cross = baselines.unnormalized_credit("gigpo", inputs, CFG)["episode"]
    np.testing.assert_allclose(cross, ROW_DEV + [0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(gigpo["step"], [6.365, 5.05, -3.23, -5.05, -3.135, 0.0, 0.0], atol=1e-12)
    # graphgpo step part: returns minus the src-group mean (see test_graphgpo_hand_example).
    graph = baselines.unnormalized_credit("graphgpo", inputs, CFG)
    np.testing.assert_allclose(graph["step"], [0.33, 4.995, 0.33, -4.995, -0.66, 0.0, 0.0], atol=1e-12)
    rtmc = baselines.unnormalized_credit("rtmc", inputs, CFG)
    np.testing.assert_array_equal(rtmc["step"], run("rtmc", steps, edges).advantage)
    with pytest.raises(GraftError, match="not a baseline"):
        baselines.unnormalized_credit("graft", inputs, CFG)


@settings(max_examples=30, deadline=None)
@given(SEEDS)
def test_normalizing_the_unnormalized_parts_gives_the_estimators(seed):
    steps, edges = _random_tables(seed)
    inputs = CreditInputs(steps, edges, pl.DataFrame(), None, GAMMA)
    state = baselines._Rows(inputs).codes("src")
    episode = baselines._grpo_episode(baselines._Rows(inputs))[0]
    for name in ("gigpo", "graphgpo"):
        parts = baselines.unnormalized_credit(name, inputs, PER_TRAJ)
        # The centered step part has the same normalization as the raw return (the mean cancels).
        step, _ = baselines._normalize_in_groups(parts["step"], state)
        omega = CFG.gigpo_omega if name == "gigpo" else 1.0
        np.testing.assert_allclose(
            run(name, steps, edges, config=PER_TRAJ).advantage, episode + omega * step, atol=1e-9
        )
    # grpo's normalized advantage is X^E divided by the group's (ddof 1) std over trajectories.
    x_e = baselines.unnormalized_credit("grpo", inputs, CFG)["episode"]
    grpo = run("grpo", steps, edges).advantage
    np.testing.assert_array_equal(np.sign(np.round(grpo, 9)), np.sign(np.round(x_e, 9)))


def test_registered_names():
    assert {"grpo", "rloo", "gigpo", "salt", "graphgpo", "rtmc"} <= set(ESTIMATORS)


# ----------------------------------------------------------------------------------------------------
# On tables from the real pipeline (stages.credit.synth -> stages.credit.trajectory_graph)


@pytest.mark.parametrize("seed", [0, 1])
def test_baselines_on_pipeline_graphs_match_the_references(seed):
    from stages.credit.synth import synth_steps
    from stages.credit.trajectory_graph import build_graph

    steps = synth_steps(groups=6, group_size=6, horizon=5, width=3, merge=0.5, success_reward=10.0, seed=seed)
    nodes, edges = build_graph(steps, canonicalize="exact")
    config = AdvantageConfig(gigpo_gamma=0.9, graphgpo_w=0.3)
    expected = {
        "grpo": ref_grpo(steps),
        "rloo": ref_rloo(steps),
        "gigpo": ref_gigpo(steps, omega=1.0, gamma=0.9, cross_steps=True),
        "salt": ref_salt(steps),
        "graphgpo": ref_graphgpo(steps, w=0.3),
        "rtmc": ref_rtmc(steps, gamma=0.8),
    }
    for name, reference in expected.items():
        out = ESTIMATORS[name](CreditInputs(steps, edges, nodes, None, 0.8), config)
        np.testing.assert_allclose(out.advantage, reference, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_graft_td_equals_rtmc_on_a_tree(gamma):
    # With no merging of different histories (merge 0 on layered MDPs: only shared prefixes, ends at
    # terminal nodes), the graph's V̂(u) is the mean discounted return over the visits of u, so
    # r + γV̂(dst) − V̂(src) = Q̂(s, a) − V̂(s): graft TD and rtmc are the same estimator there -- when
    # V̂ holds the step rewards too (solve.step_rewards = "values"; the default keeps them out of V̂).
    import stages.credit.advantage.graft  # noqa: F401  (registers "graft")
    from stages.credit.bellman import solve_values
    from stages.credit.synth import synth_steps
    from stages.credit.trajectory_graph import build_graph

    steps, _ = synth_steps(
        groups=8, group_size=8, horizon=5, width=3, merge=0.0, gamma=gamma, seed=4, truth=True
    )
    nodes, edges = build_graph(steps, canonicalize="exact")
    values = solve_values(nodes, edges, gamma=gamma, step_rewards="values")
    inputs = CreditInputs(steps, edges, nodes, values, gamma, step_rewards="values")
    td = ESTIMATORS["graft"](inputs, AdvantageConfig(gae="none", normalize="none")).advantage
    np.testing.assert_allclose(ESTIMATORS["rtmc"](inputs, CFG).advantage, td, atol=1e-9)
