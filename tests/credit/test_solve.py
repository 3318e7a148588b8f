"""Bellman values on trajectory graphs (docs/design.md §4 Solve): hand values, exact linear solve, reference."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import polars as pl
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.sparse.linalg import spsolve

from schemas import conform
from schemas.errors import GraftError
from stages.credit.bellman import k_max, solve_values
from stages.credit.synth import synth_steps
from stages.credit.trajectory_graph import build_graph
from tests.helpers.credit_cases import fig2_steps, make_steps, synth_knobs
from tests.helpers.reference_graft import reference_graph, reference_values


def _by_state(nodes: pl.DataFrame, values: pl.DataFrame, column: str = "value") -> dict[str, float]:
    joined = nodes.join(values, on=["group_id", "node"])
    return dict(zip(joined["state"].to_list(), joined[column].to_list(), strict=True))


def test_values_of_the_hand_example_step_rewards_in_credit_only():
    # Default (solve.step_rewards = "step", the paper's Eq. 7): values from the outcomes alone, so the
    # invalid self-loop at L (r = -0.1) does not lower V(L): 3V = 0.9 + 0.9V + 0  ->  V = 0.9 / 2.1.
    nodes, edges = build_graph(fig2_steps())
    V = _by_state(nodes, solve_values(nodes, edges, gamma=0.9))
    assert V["L"] == pytest.approx(0.9 / 2.1, abs=1e-7)
    assert V["D"] == pytest.approx(0.45, abs=1e-7)
    assert V["S"] == pytest.approx(0.9 * (2 * 0.9 / 2.1 + 4 * 0.45) / 6, abs=1e-7)
    assert V["G"] == pytest.approx(1.0, abs=1e-12) and V["F"] == pytest.approx(0.0, abs=1e-12)


def test_values_of_the_hand_example():
    gamma = 0.9
    nodes, edges = build_graph(fig2_steps())
    values = solve_values(nodes, edges, gamma=gamma, step_rewards="values")
    conform(values, "values")
    V = _by_state(nodes, values)
    # Ends only: G (3 successes) and F (2 failures) are sinks with their mean outcome.
    assert V["G"] == pytest.approx(1.0, abs=1e-12)
    assert V["F"] == pytest.approx(0.0, abs=1e-12)
    # D: out-edges to F, G, G and T6's cut end (R = 0): V = (0.9*0 + 0.9*1 + 0.9*1 + 0) / 4 = 0.45.
    assert V["D"] == pytest.approx(0.45, abs=1e-7)
    # L: out-edges to G, L (self-loop, r = -0.1), F: 3V = 0.9 + (-0.1 + 0.9V) + 0  ->  V = 0.8 / 2.1.
    assert V["L"] == pytest.approx(0.8 / 2.1, abs=1e-7)
    # S: 2 edges to L, 4 to D: V = 0.9 * (2 * 0.8/2.1 + 4 * 0.45) / 6.
    assert V["S"] == pytest.approx(0.9 * (2 * 0.8 / 2.1 + 4 * 0.45) / 6, abs=1e-7)
    assert all(_by_state(nodes, values, "reaches_end").values())
    # Propagation: distinct trajectories whose end is reachable. S and D reach all six ends
    # (D: its own T6 end, G and F); L reaches G (T1, T3, T5) and F (T2, T4).
    assert _by_state(nodes, values, "propagation") == {"S": 6, "L": 5, "G": 3, "D": 6, "F": 2}
    assert values["residual"].max() < 1e-8
    assert values["sweeps"].n_unique() == 1 and values["sweeps"][0] >= 2


def test_bootstrap_values_of_the_hand_example():
    nodes, edges = build_graph(fig2_steps(), truncation="bootstrap")
    V = _by_state(nodes, solve_values(nodes, edges, gamma=0.9, step_rewards="values"))
    # T6's cut end at D is dropped: D = (0 + 0.9 + 0.9) / 3 = 0.6, S = 0.9 (2 L + 4 D) / 6.
    assert V["D"] == pytest.approx(0.6, abs=1e-7)
    assert V["S"] == pytest.approx(0.9 * (2 * 0.8 / 2.1 + 4 * 0.6) / 6, abs=1e-7)


def test_nodes_reaching_no_end_keep_zero():
    # T1 loops A -> B -> A with penalties and is cut at A (bootstrap drops the end: A continues),
    # so A and B reach no end; their Bellman equations alone would give V = -0.1 / (1 - γ).
    steps = pl.concat(
        [
            make_steps(
                [("T1", [("A", "B", -0.1), ("B", "A", -0.1)], 0.0, "truncated")], group="g1", task="t1"
            ),
            make_steps([("T2", [("Z", "E", 0.0)], 1.0, "terminated")], group="g2", task="t2"),
        ]
    )
    nodes, edges = build_graph(steps, truncation="bootstrap")
    values = solve_values(nodes, edges, gamma=0.9)
    g1 = values.filter(pl.col("group_id") == "g1")
    assert g1["value"].to_list() == [0.0, 0.0]
    assert g1["reaches_end"].to_list() == [False, False]
    assert g1["propagation"].to_list() == [0, 0]
    assert g1["sweeps"].to_list() == [0, 0]
    g2 = values.filter(pl.col("group_id") == "g2")
    assert g2["value"].to_list() == pytest.approx([0.9, 1.0])


def test_gamma_one_needs_an_acyclic_graph():
    nodes, edges = build_graph(fig2_steps())  # L has a self-loop
    with pytest.raises(GraftError, match="group 'g'.*cycle"):
        solve_values(nodes, edges, gamma=1.0)
    steps = make_steps(
        [
            ("T1", [("S", "A", 0.0), ("A", "G", 0.0)], 1.0, "terminated"),
            ("T2", [("S", "G", 0.0)], 1.0, "terminated"),
            ("T3", [("S", "A", 0.0), ("A", "F", 0.0)], 0.0, "terminated"),
        ]
    )
    nodes, edges = build_graph(steps)
    V = _by_state(nodes, solve_values(nodes, edges, gamma=1.0))
    # A = (1 + 0) / 2; S = (A + 1 + A) / 3 with γ = 1.
    assert V["A"] == pytest.approx(0.5) and V["S"] == pytest.approx(2 / 3)


def test_sweep_limit():
    assert k_max(0.99, 1e-8, 10) == math.ceil(math.log(1e-8) / math.log(0.99)) + 50 == 1883
    assert k_max(1.0, 1e-8, 10) == 60
    # A and B (both one hop from the end E, so one level, updated together) send 1000 edges to each
    # other and one to E: a sweep contracts by ρ = 0.99 * 1000/1001, so after k_max = 1883 sweeps
    # |ΔV| ≈ V* ρ^k (1 - ρ) ≈ 1e-5 is still above ε: the solver stops at k_max.
    loop = [("A", "B", 0.0), ("B", "A", 0.0)] * 1000
    steps = make_steps(
        [("T1", [*loop, ("A", "E", 0.0)], 1e6, "terminated"), ("T2", [("B", "E", 0.0)], 1e6, "terminated")]
    )
    nodes, edges = build_graph(steps)
    values = solve_values(nodes, edges, gamma=0.99)
    assert values["sweeps"][0] == k_max(0.99, 1e-8, 3) == 1883
    assert values["residual"][0] >= 1e-8
    steps = make_steps([("T1", [("A", "A", -0.1)] * 5 + [("A", "E", 0.0)], 1.0, "terminated")])
    nodes, edges = build_graph(steps)
    values = solve_values(nodes, edges, gamma=0.5)
    assert 1 < values["sweeps"][0] < 77 and values["residual"][0] < 1e-8


# ---------------------------------------------------------------------------------------------
# the fixed point equals an exact linear solve (independent construction with networkx + scipy)


def exact_values(
    nodes: pl.DataFrame, edges: pl.DataFrame, gamma: float, step_rewards: str = "step"
) -> dict[tuple[str, int], float]:
    """Solve (I − γW) V = b on end-reaching nodes of each group; others 0 (b has r only for "values")."""
    out: dict[tuple[str, int], float] = {}
    for (group,), part in nodes.group_by(["group_id"], maintain_order=True):
        g_edges = edges.filter(pl.col("group_id") == group)
        graph = nx.MultiDiGraph()
        graph.add_nodes_from(part["node"].to_list())
        for src, dst, r in g_edges.select("src", "dst", "reward").iter_rows():
            graph.add_edge(src, dst, reward=r)
        ends = {n: (e, v) for n, e, v in part.select("node", "ends", "end_value").iter_rows() if e > 0}
        reach = [n for n in graph.nodes if n in ends or any(d in ends for d in nx.descendants(graph, n))]
        pos = {n: i for i, n in enumerate(reach)}
        k = len(reach)
        mat = sp.lil_matrix((k, k))
        b = np.zeros(k)
        for n in reach:
            e, v = ends.get(n, (0, 0.0))
            n_u = graph.out_degree(n) + e
            mat[pos[n], pos[n]] += 1.0
            b[pos[n]] += e * v / n_u
            for _, dst, data in graph.out_edges(n, data=True):
                if step_rewards == "values":
                    b[pos[n]] += data["reward"] / n_u
                if dst in pos:
                    mat[pos[n], pos[dst]] -= gamma / n_u
        sol = spsolve(mat.tocsc(), b) if k else np.zeros(0)
        for n in graph.nodes:
            out[(group, n)] = float(np.atleast_1d(sol)[pos[n]]) if n in pos else 0.0
    return out


synth_knob_sets = synth_knobs(invalid_penalty=st.sampled_from([0.0, -0.1, -1.0]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    knobs=synth_knob_sets,
    gamma=st.floats(0.3, 0.995),
    truncation=st.sampled_from(["fail", "bootstrap"]),
    step_rewards=st.sampled_from(["step", "values"]),
)
def test_fixed_point_equals_exact_linear_solve(knobs, gamma, truncation, step_rewards):
    steps = synth_steps(**knobs)
    nodes, edges = build_graph(steps, truncation=truncation)
    values = solve_values(nodes, edges, gamma=gamma, step_rewards=step_rewards)
    exact = exact_values(nodes, edges, gamma, step_rewards)
    got = {(g, n): v for g, n, v in values.select("group_id", "node", "value").iter_rows()}
    assert got.keys() == exact.keys()
    assert max(abs(got[k] - exact[k]) for k in got) < 1e-6
    assert (values["residual"] < 1e-8).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    knobs=synth_knob_sets,
    gamma=st.floats(0.3, 0.995),
    truncation=st.sampled_from(["fail", "bootstrap"]),
    step_rewards=st.sampled_from(["step", "values"]),
)
def test_solve_matches_the_literal_reference(knobs, gamma, truncation, step_rewards):
    steps = synth_steps(**knobs)
    nodes, edges = build_graph(steps, truncation=truncation)
    values = solve_values(nodes, edges, gamma=gamma, step_rewards=step_rewards)
    ref = reference_values(reference_graph(steps.to_dicts(), truncation), gamma, step_rewards=step_rewards)
    for group, node, value, reaches, prop in values.select(
        "group_id", "node", "value", "reaches_end", "propagation"
    ).iter_rows():
        assert abs(value - ref[group]["V"][node]) < 1e-6
        assert reaches == ref[group]["reaches"][node]
        assert prop == ref[group]["propagation"][node]


def test_gamma_one_on_layered_synth_matches_exact_solve():
    steps, _ = synth_steps(groups=3, group_size=8, horizon=6, truth=True, seed=5)
    nodes, edges = build_graph(steps)
    values = solve_values(nodes, edges, gamma=1.0, step_rewards="values")
    exact = exact_values(nodes, edges, 1.0, "values")
    for g, n, v in values.select("group_id", "node", "value").iter_rows():
        assert abs(v - exact[(g, n)]) < 1e-9
