"""Graph diagnostics (stages.credit.diagnostics) against a plain reference: string joins and one filter per type."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from stages.credit.bellman import index_graph, solve_values
from stages.credit.diagnostics import diagnostics_frame, graph_metrics, solve_metrics
from stages.credit.synth import synth_steps
from stages.credit.trajectory_graph import build_graph


def _ref_graph(nodes: pl.DataFrame, edges: pl.DataFrame) -> dict[str, float]:
    with_out = nodes.filter(pl.col("out_edges") > 0)["out_edges"]
    size = edges.join(
        nodes.select("group_id", src=pl.col("node"), size=pl.col("out_edges")), on=["group_id", "src"]
    )["size"]
    groups = nodes["group_id"].n_unique()
    return {
        "groups": groups,
        "nodes": nodes.height,
        "edges": edges.height,
        "ends": nodes["ends"].sum(),
        "nodes_per_group": nodes.height / groups,
        "mean_node_group_size": with_out.mean() if with_out.len() else 0.0,
        "share_steps_group_ge2": (size >= 2).mean(),
    }


def _ref_solve(values: pl.DataFrame, edges: pl.DataFrame) -> dict[str, float]:
    prop = edges.join(
        values.select("group_id", src=pl.col("node"), p=pl.col("propagation")), on=["group_id", "src"]
    )["p"].to_numpy()
    per_group = values.group_by("group_id").agg(pl.col("sweeps").first(), pl.col("residual").first())
    q = np.quantile(prop, [0.1, 0.5, 0.9])
    return {
        "propagation_mean": prop.mean(),
        "propagation_p10": q[0],
        "propagation_p50": q[1],
        "propagation_p90": q[2],
        "share_steps_propagation_1": (prop == 1).mean(),
        "share_nodes_no_end": (~values["reaches_end"]).mean(),
        "sweeps_max": per_group["sweeps"].max(),
        "sweeps_mean": per_group["sweeps"].mean(),
        "residual_max": per_group["residual"].max(),
    }


def _reference_rows(stage: str, steps: pl.DataFrame, first: pl.DataFrame, edges: pl.DataFrame) -> dict:
    fn = _ref_graph if stage == "graph" else _ref_solve
    rows = {(None, k): float(v) for k, v in fn(first, edges).items()}
    types = steps.select("group_id", "task_type").unique()
    names = sorted(t for t in types["task_type"].unique().to_list() if t)
    if len(names) > 1:
        for name in names:
            groups = types.filter(pl.col("task_type") == name)["group_id"].implode()
            part = fn(
                first.filter(pl.col("group_id").is_in(groups)), edges.filter(pl.col("group_id").is_in(groups))
            )
            rows.update({(name, k): float(v) for k, v in part.items()})
    return rows


def _frame_rows(frame: pl.DataFrame) -> dict:
    return {(t, n): v for n, v, t in frame.select("name", "value", "task_type").iter_rows()}


@pytest.mark.parametrize("two_types_in_a_group", [False, True])
def test_diagnostics_equal_the_per_type_reference(two_types_in_a_group):
    steps = synth_steps(groups=9, group_size=4, horizon=8, seed=5, cycles=0.2, end_rate=0.2)
    if two_types_in_a_group:  # a group whose trajectories carry two types counts under both
        first_group = steps["group_id"][0]
        half = (pl.col("group_id") == first_group) & (pl.col("step") % 2 == 0)
        steps = steps.with_columns(task_type=pl.when(half).then(pl.lit("zeta")).otherwise("task_type"))
    steps = steps.with_columns(
        task_type=pl.when(pl.col("group_id") == steps["group_id"][-1]).then(pl.lit("")).otherwise("task_type")
    )
    nodes, edges = build_graph(steps)
    values = solve_values(nodes, edges, gamma=0.9)
    index = index_graph(nodes, edges)
    for stage, first in (("graph", nodes), ("solve", values)):
        ref = _reference_rows(stage, steps, first, edges)
        assert len({t for t, _ in ref}) >= 4
        for given in (None, index):
            fn = graph_metrics if stage == "graph" else solve_metrics
            overall = fn(first, edges, given)
            got = _frame_rows(diagnostics_frame(0, stage, overall, steps, (first, edges), given))
            assert got.keys() == ref.keys()
            for key, value in ref.items():
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_one_task_type_gives_overall_rows_only():
    steps = synth_steps(groups=3, group_size=2, horizon=5, seed=1).with_columns(task_type=pl.lit("only"))
    nodes, edges = build_graph(steps)
    frame = diagnostics_frame(2, "graph", graph_metrics(nodes, edges), steps, (nodes, edges))
    assert frame["task_type"].null_count() == frame.height == 7
    assert frame["iter"].unique().to_list() == [2]
