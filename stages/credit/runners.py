"""The graph, solve and advantage stage runners (run directory), and the same steps on plain files (the
CLI's file mode): metrics rows first (``metrics_<stage>.parquet``), outputs atomically."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from schemas import read_table, validate_steps, write_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import Run
from stages.credit.advantage.compute import compute_advantages
from stages.credit.advantage.oracle import BENCH_ORACLES
from stages.credit.api import (
    advantage_metrics,
    embed_metrics,
    graph_from_config,
    make_embedder,
    values_from_config,
)
from stages.credit.bellman import GraphIndex, index_graph
from stages.credit.diagnostics import diagnostics_frame, graph_metrics, solve_metrics


def write_metrics(
    folder: Path,
    stage: str,
    iteration: int,
    metrics: dict[str, float],
    steps: pl.DataFrame | None = None,
    tables: tuple[pl.DataFrame, pl.DataFrame] | None = None,
    index: GraphIndex | None = None,
) -> Path:
    """Write ``metrics_<stage>.parquet`` (table ``metrics``; per task type too) into ``folder`` atomically."""
    frame = diagnostics_frame(iteration, stage, metrics, steps, tables, index)
    return write_table(frame, "metrics", folder / f"metrics_{stage}.parquet")


@dataclass
class ChainTables:
    """Tables a file-mode chain (graph -> solve -> advantage in one process) already holds in memory.

    Each stage function fills in what it read or computed and reuses what is there, so every input is
    read once; every output is still written (atomically, stamped). None: not in memory, read from disk.
    ``steps`` is kept only after validation; ``index`` is index_graph(nodes, edges).
    """

    steps: pl.DataFrame | None = None
    nodes: pl.DataFrame | None = None
    edges: pl.DataFrame | None = None
    index: GraphIndex | None = None
    values: pl.DataFrame | None = None


def graph_files(
    steps_path: Path,
    out_dir: Path,
    config: Config,
    iteration: int = 0,
    require_stamp: bool = True,
    chain: ChainTables | None = None,
) -> None:
    """steps.parquet -> out_dir/{metrics_graph, nodes, edges}.parquet (embedding cache: out_dir/cache)."""
    _graph_stage(
        steps_path, out_dir, out_dir / "cache" / "embeddings.parquet", config, iteration, require_stamp, chain
    )


def _graph_stage(
    steps_path: Path,
    folder: Path,
    cache: Path,
    config: Config,
    iteration: int,
    require_stamp: bool,
    chain: ChainTables | None = None,
) -> None:
    t0 = time.perf_counter()
    chain = chain if chain is not None else ChainTables()
    steps = chain.steps
    if steps is None:
        steps = read_table(steps_path, "steps", require_stamp=require_stamp)
        validate_steps(steps, source=str(steps_path))
    embedder = make_embedder(config, cache)
    nodes, edges = graph_from_config(steps, config, embedder)
    index = index_graph(nodes, edges) if nodes.height else None
    metrics = {
        **graph_metrics(nodes, edges, index),
        **embed_metrics(embedder),
        "seconds": time.perf_counter() - t0,
    }
    write_metrics(folder, "graph", iteration, metrics, steps, (nodes, edges), index)
    write_table(nodes, "nodes", folder / "nodes.parquet")
    write_table(edges, "edges", folder / "edges.parquet")
    chain.steps, chain.nodes, chain.edges, chain.index, chain.values = steps, nodes, edges, index, None


def solve_files(
    folder: Path,
    config: Config,
    iteration: int = 0,
    steps_path: Path | None = None,
    chain: ChainTables | None = None,
) -> None:
    """folder/{nodes, edges}.parquet -> folder/{metrics_solve, values}.parquet.

    ``steps_path`` (optional) adds per-task-type propagation rows to the metrics.
    """
    t0 = time.perf_counter()
    chain = chain if chain is not None else ChainTables()
    if chain.nodes is None or chain.edges is None:
        chain.nodes = read_table(folder / "nodes.parquet", "nodes")
        chain.edges = read_table(folder / "edges.parquet", "edges")
        chain.index = None
    nodes, edges = chain.nodes, chain.edges
    index = chain.index if chain.index is not None else index_graph(nodes, edges)
    values = values_from_config(nodes, edges, config, index)
    metrics = {**solve_metrics(values, edges, index), "seconds": time.perf_counter() - t0}
    steps = chain.steps
    if steps is None and steps_path is not None and steps_path.is_file():
        steps = read_table(steps_path, "steps", require_stamp=False).select("group_id", "task_type")
    write_metrics(folder, "solve", iteration, metrics, steps, (values, edges), index)
    write_table(values, "values", folder / "values.parquet")
    chain.index, chain.values = index, values


def advantage_files(
    steps_path: Path,
    folder: Path,
    config: Config,
    iteration: int = 0,
    require_stamp: bool = True,
    chain: ChainTables | None = None,
) -> None:
    """steps + folder/{nodes, edges, values} -> folder/{metrics_advantage, advantages}.parquet."""
    t0 = time.perf_counter()
    chain = chain if chain is not None else ChainTables()
    steps = chain.steps
    if steps is None:
        steps = read_table(steps_path, "steps", require_stamp=require_stamp)
    if chain.nodes is None or chain.edges is None:
        chain.nodes = read_table(folder / "nodes.parquet", "nodes")
        chain.edges = read_table(folder / "edges.parquet", "edges")
        chain.index = None
    if chain.values is None:
        chain.values = read_table(folder / "values.parquet", "values")
    oracle = None
    if config.advantage.estimator in BENCH_ORACLES:
        oracle_path = folder / "oracle.parquet"
        if not oracle_path.is_file():
            raise GraftError(
                f"advantage: estimator '{config.advantage.estimator}' reads {oracle_path}, the rollout "
                "stage's Monte-Carlo continuations, and it is missing (rerun the rollout with this estimator)"
            )
        oracle = read_table(oracle_path, "oracle")
    adv = compute_advantages(
        steps,
        chain.nodes,
        chain.edges,
        chain.values,
        config.advantage,
        config.solve.gamma,
        index=chain.index,
        step_rewards=config.solve.step_rewards,
        oracle=oracle,
    )
    bad = adv.filter(~pl.col("advantage").is_finite())
    if bad.height:
        row = bad.row(0, named=True)
        raise GraftError(
            f"advantage: {bad.height} advantage(s) are not finite (first: traj_id {row['traj_id']!r}, step "
            f"{row['step']}: {row['advantage']}); the steps' rewards or outcomes overflow float64"
        )
    write_metrics(
        folder, "advantage", iteration, {**advantage_metrics(adv), "seconds": time.perf_counter() - t0}
    )
    write_table(adv, "advantages", folder / "advantages.parquet")


def run_graph(run: Run, iteration: int, config: Config) -> None:
    """Stage runner: steps -> metrics_graph, nodes, edges (embedding cache in <run>/cache/)."""
    cache = run.root / "cache" / "embeddings.parquet"
    _graph_stage(run.table_path(iteration, "steps"), run.iter_dir(iteration), cache, config, iteration, True)


def run_solve(run: Run, iteration: int, config: Config) -> None:
    """Stage runner: nodes, edges -> metrics_solve, values."""
    solve_files(run.iter_dir(iteration), config, iteration, run.table_path(iteration, "steps"))


def run_advantage(run: Run, iteration: int, config: Config) -> None:
    """Stage runner: steps, nodes, edges, values -> metrics_advantage, advantages."""
    advantage_files(run.table_path(iteration, "steps"), run.iter_dir(iteration), config, iteration)
