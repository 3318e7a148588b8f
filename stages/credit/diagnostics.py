"""Graph diagnostics as long-format metrics rows (docs/design.md §4 end, paper App. D.2-D.3).

Metric names (stage ``graph``):
  groups, nodes, edges, ends                      counts over all groups
  nodes_per_group                                 mean nodes per group
  mean_node_group_size                            mean out-edge instances per node that has out-edges
                                                  (App. D.2 "node group size")
  share_steps_group_ge2                           share of steps whose src node has >= 2 out-edges
                                                  (the steps that get an on-state action group)
Metric names (stage ``solve``):
  propagation_mean, propagation_p10/p50/p90       information propagation degree of each step's src
                                                  node (distinct trajectories whose end is reachable,
                                                  App. D.3), over steps
  share_steps_propagation_1                       share of steps whose src has propagation 1
  share_nodes_no_end                              share of nodes that reach no end (V = 0)
  sweeps_max, sweeps_mean, residual_max           Gauss-Seidel sweeps and final max |ΔV| over groups

``diagnostics_frame`` also repeats the graph and propagation metrics per ``task_type`` (rows with
``task_type`` set) when the steps carry more than one non-empty type; a group counts under every
non-empty type its steps carry.

Implementation: every metric is an aggregate over integer codes -- per node (out-edges, ends, the
edges leaving it), per edge (its src's propagation) or per group (sweeps, residual) of the global
numbering ``stages.credit.bellman.index_graph`` builds -- so the overall rows are one ``select`` and the
per-task-type rows one ``group_by`` over the type code of each row's group, without string joins.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from schemas.metrics import metrics_frame
from stages.credit.bellman import GraphIndex, gather_ranges, index_graph

_GRAPH_NAMES = (
    "groups",
    "nodes",
    "edges",
    "ends",
    "nodes_per_group",
    "mean_node_group_size",
    "share_steps_group_ge2",
)
_SOLVE_NAMES = (
    "propagation_mean",
    "propagation_p10",
    "propagation_p50",
    "propagation_p90",
    "share_steps_propagation_1",
    "share_nodes_no_end",
    "sweeps_max",
    "sweeps_mean",
    "residual_max",
)


def _graph_exprs() -> list[pl.Expr]:
    """Graph metrics over a node frame (g: group code, out: out_edges, ends, leave: edges leaving)."""
    out, leave = pl.col("out"), pl.col("leave")
    edges = leave.sum()
    groups = pl.col("g").n_unique()
    return [
        groups.cast(pl.Float64).alias("groups"),
        pl.len().cast(pl.Float64).alias("nodes"),
        edges.cast(pl.Float64).alias("edges"),
        pl.col("ends").sum().cast(pl.Float64).alias("ends"),
        (pl.len() / groups).fill_nan(0.0).alias("nodes_per_group"),
        out.filter(out > 0).mean().cast(pl.Float64).fill_null(0.0).alias("mean_node_group_size"),
        pl.when(edges > 0)
        .then(leave.filter(out >= 2).sum() / edges)
        .otherwise(0.0)
        .cast(pl.Float64)
        .alias("share_steps_group_ge2"),
    ]


def _prop_exprs() -> list[pl.Expr]:
    """Propagation metrics over an edge frame (p: propagation of the edge's src node)."""
    p = pl.col("p")
    quantile = [
        p.quantile(q, interpolation="linear").alias(f"propagation_p{round(100 * q)}") for q in (0.1, 0.5, 0.9)
    ]
    return [
        p.mean().alias("propagation_mean"),
        *quantile,
        (p == 1).mean().alias("share_steps_propagation_1"),
    ]


def _node_frame(index: GraphIndex) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "g": index.node_group,
            "out": index.nodes["out_edges"].to_numpy(),
            "ends": index.ends,
            "leave": np.bincount(index.src, minlength=index.n_nodes),
        }
    )


def _dict(row: pl.DataFrame, names: tuple[str, ...]) -> dict[str, float]:
    return {name: float(row[name][0] if row[name][0] is not None else 0.0) for name in names}


def graph_metrics(
    nodes: pl.DataFrame, edges: pl.DataFrame, index: GraphIndex | None = None
) -> dict[str, float]:
    """Structure of the trajectory graphs (see the module docstring); ``index``: index_graph(nodes, edges)."""
    if nodes.height == 0:
        return dict.fromkeys(_GRAPH_NAMES, 0.0)
    frame = _node_frame(index or index_graph(nodes, edges))
    return _dict(frame.select(_graph_exprs()), _GRAPH_NAMES)


def _solve_frames(values: pl.DataFrame, index: GraphIndex) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(node, edge, group) frames of the solve metrics; ``values`` rows in ``index.nodes`` order."""
    nodes = pl.DataFrame({"g": index.node_group, "no_end": ~values["reaches_end"].to_numpy()})
    prop = values["propagation"].to_numpy()
    edges = pl.DataFrame({"g": index.edge_group, "p": prop[index.src]})
    first = index.offsets[:-1][np.diff(index.offsets) > 0]
    groups = pl.DataFrame(
        {
            "g": index.node_group[first],
            "sweeps": values["sweeps"].to_numpy()[first],
            "residual": values["residual"].to_numpy()[first],
        }
    )
    return nodes, edges, groups


_NO_END = pl.col("no_end").mean().cast(pl.Float64).alias("share_nodes_no_end")
_SOLVER = [
    pl.col("sweeps").max().cast(pl.Float64).alias("sweeps_max"),
    pl.col("sweeps").mean().cast(pl.Float64).alias("sweeps_mean"),
    pl.col("residual").max().cast(pl.Float64).alias("residual_max"),
]


def solve_metrics(
    values: pl.DataFrame, edges: pl.DataFrame, index: GraphIndex | None = None
) -> dict[str, float]:
    """Propagation degree distribution over steps and solver statistics (see the module docstring).

    ``values`` as stages.credit.bellman.solve_values returns them (rows in the order of ``index.nodes``);
    ``index``: the graph the values were solved on (index_graph(nodes, edges)).
    """
    if values.height == 0:
        return dict.fromkeys(_SOLVE_NAMES, 0.0)
    if index is None:
        index = index_graph(_nodes_of(values, edges), edges)
    nodes, edge_frame, groups = _solve_frames(values, index)
    row = pl.concat(
        [edge_frame.select(_prop_exprs()), nodes.select(_NO_END), groups.select(_SOLVER)], how="horizontal"
    )
    return _dict(row, _SOLVE_NAMES)


def _nodes_of(values: pl.DataFrame, edges: pl.DataFrame) -> pl.DataFrame:
    """A minimal nodes table for index_graph from a values table (out-edges recounted from edges)."""
    return values.select(
        "group_id", "node", out_edges=pl.lit(0, dtype=pl.Int32), ends=pl.lit(0), end_value=pl.lit(None)
    )


def _types_of_groups(steps: pl.DataFrame, index: GraphIndex) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Distinct (group code, type code) pairs sorted by group, and the type names (sorted, non-empty).

    Empty when the steps carry fewer than two non-empty task types (no per-type rows then).
    """
    none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), [])
    pairs = (
        steps.select(
            g=pl.col("group_id").cast(pl.Enum(index.groups), strict=False).to_physical(),
            t=pl.col("task_type").fill_null(""),
        )
        .unique()
        .filter((pl.col("t") != "") & pl.col("g").is_not_null())
    )
    names = pairs["t"].unique().sort().to_list()
    if len(names) < 2:
        return none
    pairs = pairs.with_columns(t=pl.col("t").cast(pl.Enum(names)).to_physical()).sort("g", "t")
    return pairs["g"].to_numpy().astype(np.int64), pairs["t"].to_numpy().astype(np.int64), names


def _by_type(
    frame: pl.DataFrame, pair_group: np.ndarray, pair_type: np.ndarray, n_groups: int
) -> pl.DataFrame:
    """``frame`` (column g: group code) with a type code column t, one copy of a row per type of its group."""
    ptr = np.concatenate([[0], np.cumsum(np.bincount(pair_group, minlength=n_groups))])
    g = frame["g"].to_numpy()
    count = ptr[g + 1] - ptr[g]
    if np.all(count == 1):
        return frame.with_columns(t=pair_type[ptr[g]])
    rows = np.repeat(np.arange(g.size), count)
    return frame[rows].with_columns(t=pair_type[gather_ranges(ptr, g)])


def _per_type(
    stage: str, first: pl.DataFrame, edges: pl.DataFrame, steps: pl.DataFrame, index: GraphIndex | None
) -> list[tuple[str, dict[str, float]]]:
    """(type name, metrics) per task type, sorted by name; one group_by over type codes per frame."""
    if first.height == 0:
        return []
    if index is None:
        index = index_graph(first if stage == "graph" else _nodes_of(first, edges), edges)
    pair_group, pair_type, names = _types_of_groups(steps, index)
    if not names:
        return []
    n_groups = index.groups.len()

    def grouped(frame: pl.DataFrame, exprs: list[pl.Expr]) -> pl.DataFrame:
        typed = _by_type(frame, pair_group, pair_type, n_groups)
        return typed.group_by("t").agg(exprs).sort("t")

    if stage == "graph":
        table, keys = grouped(_node_frame(index), _graph_exprs()), _GRAPH_NAMES
    else:
        nodes, edge_frame, groups = _solve_frames(first, index)
        parts = [grouped(edge_frame, _prop_exprs()), grouped(nodes, [_NO_END]), grouped(groups, _SOLVER)]
        table = parts[0].join(parts[1], on="t").join(parts[2], on="t").sort("t")
        keys = _SOLVE_NAMES
    return [(names[t], _dict(table[i], keys)) for i, t in enumerate(table["t"].to_list())]


def diagnostics_frame(
    iteration: int,
    stage: str,
    metrics: dict[str, float],
    steps: pl.DataFrame | None = None,
    tables: tuple[pl.DataFrame, pl.DataFrame] | None = None,
    index: GraphIndex | None = None,
) -> pl.DataFrame:
    """Metrics rows of a stage, plus per-task-type rows of its diagnostics.

    ``tables`` is (nodes, edges) for stage ``graph`` or (values, edges) for stage ``solve``;
    ``index`` (optional): index_graph(nodes, edges) of those tables, when the caller has it.
    """
    frames = [metrics_frame(iteration, stage, metrics)]
    if steps is not None and tables is not None and "task_type" in steps.columns:
        first, edges = tables
        for name, values in _per_type(stage, first, edges, steps, index):
            frames.append(metrics_frame(iteration, stage, values, task_type=name))
    return pl.concat(frames)
