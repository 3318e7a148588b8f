"""GRAFT step credit from Python, and the graph / solve / advantage stage runners.

For people who bring their own rollouts (a steps table per SPEC §3, e.g. converted from verl-agent
or TRL)::

    import polars as pl
    from stages import credit

    steps = pl.read_parquet("my_steps.parquet")
    tables = credit.run_all(steps)                    # default Config: exact graph, γ=0.99, graft
    tables.advantages["advantage"]                    # one row per steps row, same order

    nodes, edges = credit.graph(steps, canonicalize="exact")
    values = credit.solve(nodes, edges, gamma=0.99)
    adv = credit.advantages(steps, nodes, edges, values, estimator="graft", gae="graph", lam=0.95)

Every function validates what it is given and raises ``GraftError`` (one line) on bad input.

Stage runners (docs/design.md): ``run_graph``, ``run_solve``, ``run_advantage`` read and write
``iter_NNNN/*.parquet`` in a run, metrics rows first (``metrics_<stage>.parquet``), outputs atomically.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from schemas import conform, read_table, validate_steps, write_table
from schemas.config import AdvantageConfig, Config
from schemas.errors import GraftError
from schemas.metrics import metrics_frame
from schemas.rundir import Run
from stages.advantage.compute import compute_advantages
from stages.diagnostics import diagnostics_frame, graph_metrics, solve_metrics
from stages.graph import Embedder, build_graph
from stages.solve import GraphIndex, index_graph, solve_values


@dataclass(frozen=True)
class CreditTables:
    """The four credit tables (schemas NODES, EDGES, VALUES, ADVANTAGES) and their metrics rows."""

    nodes: pl.DataFrame
    edges: pl.DataFrame
    values: pl.DataFrame
    advantages: pl.DataFrame
    metrics: pl.DataFrame


def _as_steps(steps: pl.DataFrame, source: str) -> pl.DataFrame:
    """Conform (types, optional columns) and validate a steps table."""
    table = pl.from_arrow(conform(steps, "steps", source=source))
    assert isinstance(table, pl.DataFrame)
    validate_steps(table, source=source)
    return table


def make_embedder(config: Config, cache: str | Path | None = None) -> Embedder | None:
    """The sentence encoder for ``graph.canonicalize = "similarity"`` (None for exact matching)."""
    if config.graph.canonicalize != "similarity":
        return None
    from stages.embed import SentenceEncoder

    return SentenceEncoder(
        config.graph.embed_model, config.graph.embed_batch, cache, config.graph.long_states
    )


def graph_of(
    steps: pl.DataFrame, config: Config, embedder: Embedder | None = None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """build_graph with the ``[graph]`` settings of ``config`` (embedder: make_embedder's when None)."""
    g = config.graph
    embedder = embedder if embedder is not None else make_embedder(config)
    return build_graph(steps, g.canonicalize, g.tau, g.truncation, embedder, g.time_key)


def values_of(nodes: pl.DataFrame, edges: pl.DataFrame, config: Config, index: GraphIndex) -> pl.DataFrame:
    """solve_values with the ``[solve]`` settings of ``config``."""
    s = config.solve
    return solve_values(nodes, edges, s.gamma, s.eps, index=index, step_rewards=s.step_rewards)


def embed_metrics(embedder: Embedder | None) -> dict[str, float]:
    """``similarity_truncated``: state texts longer than the encoder's window (embedded in windows)."""
    over = getattr(embedder, "over_window", None)
    return {} if over is None else {"similarity_truncated": float(over)}


def graph(
    steps: pl.DataFrame,
    canonicalize: str = "exact",
    tau: float = 0.9,
    truncation: str = "fail",
    embedder: Embedder | None = None,
    *,
    validate: bool = True,
    source: str = "<steps>",
    time_key: bool = False,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(nodes, edges) of every group's trajectory graph; see stages.graph.build_graph."""
    if validate:
        steps = _as_steps(steps, source)
    return build_graph(steps, canonicalize, tau, truncation, embedder, time_key)  # type: ignore[arg-type]


def solve(
    nodes: pl.DataFrame,
    edges: pl.DataFrame,
    gamma: float = 0.99,
    eps: float = 1e-8,
    step_rewards: str = "step",
) -> pl.DataFrame:
    """Values table (Bellman fixed point per node); see stages.solve.solve_values."""
    nodes = pl.from_arrow(conform(nodes, "nodes", source="<nodes>"))  # type: ignore[assignment]
    edges = pl.from_arrow(conform(edges, "edges", source="<edges>"))  # type: ignore[assignment]
    return solve_values(nodes, edges, gamma, eps, step_rewards=step_rewards)


def advantages(
    steps: pl.DataFrame,
    nodes: pl.DataFrame | None = None,
    edges: pl.DataFrame | None = None,
    values: pl.DataFrame | None = None,
    config: Config | AdvantageConfig | None = None,
    *,
    validate: bool = True,
    **options: Any,
) -> pl.DataFrame:
    """Advantages table for ``steps``; graph and values are computed when not given.

    ``config``: a full Config (graph/solve/advantage sections used) or an AdvantageConfig; keyword
    ``options`` override AdvantageConfig fields (``estimator="grpo"``, ``lam=0.6``, ...);
    ``gamma`` and ``step_rewards`` override solve.gamma and solve.step_rewards.
    """
    full = config if isinstance(config, Config) else Config()
    adv = config if isinstance(config, AdvantageConfig) else full.advantage
    gamma = float(options.pop("gamma", full.solve.gamma))
    step_rewards = str(options.pop("step_rewards", full.solve.step_rewards))
    if options:
        known = {f.name for f in dataclasses.fields(AdvantageConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise GraftError(
                f"unknown advantage option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
            )
        adv = dataclasses.replace(adv, **options)
    if validate:
        steps = _as_steps(steps, "<steps>")
    if nodes is None or edges is None:
        nodes, edges = graph_of(steps, full)
    if values is None:
        values = solve_values(nodes, edges, gamma, full.solve.eps, step_rewards=step_rewards)
    return compute_advantages(steps, nodes, edges, values, adv, gamma, step_rewards=step_rewards)


def run_all(
    steps: pl.DataFrame, config: Config | None = None, embedder: Embedder | None = None
) -> CreditTables:
    """Validate ``steps``, then graph -> solve -> advantage with ``config`` (default Config())."""
    config = config or Config()
    steps = _as_steps(steps, "<steps>")
    t0 = time.perf_counter()
    embedder = embedder or make_embedder(config)
    nodes, edges = graph_of(steps, config, embedder)
    t1 = time.perf_counter()
    index = index_graph(nodes, edges)
    values = values_of(nodes, edges, config, index)
    t2 = time.perf_counter()
    adv = compute_advantages(
        steps,
        nodes,
        edges,
        values,
        config.advantage,
        config.solve.gamma,
        index=index,
        step_rewards=config.solve.step_rewards,
    )
    t3 = time.perf_counter()
    iteration = int(steps["iter"][0]) if steps.height else 0
    metrics = pl.concat(
        [
            metrics_frame(
                iteration,
                "graph",
                {**graph_metrics(nodes, edges, index), **embed_metrics(embedder), "seconds": t1 - t0},
            ),
            metrics_frame(iteration, "solve", {**solve_metrics(values, edges, index), "seconds": t2 - t1}),
            metrics_frame(iteration, "advantage", {**advantage_metrics(adv), "seconds": t3 - t2}),
        ]
    )
    return CreditTables(nodes, edges, values, adv, metrics)


def advantage_metrics(adv: pl.DataFrame) -> dict[str, float]:
    """Summary of the credit the loss will use."""
    a = adv["advantage"]
    out = {
        "advantage_mean": float(a.mean() or 0.0),
        "advantage_std": float(a.std() or 0.0),
        "advantage_abs_mean": float(a.abs().mean() or 0.0),
        "norm_group_size_mean": float(adv["norm_group_size"].mean() or 0.0),
    }
    if adv["td"].null_count() < adv.height:
        out["td_abs_mean"] = float(adv["td"].abs().mean() or 0.0)
    return out


# ---------------------------------------------------------------------------------------------
# stage runners (run directory) and the same steps on plain files (the CLI's file mode)


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
class Held:
    """Tables a file-mode chain (graph -> solve -> advantage in one process) already holds in memory.

    Each stage function fills in what it read or computed and reuses what is there, so every input is
    read once; every output is still written (atomically, stamped). None: not held, read from disk.
    ``steps`` is held only after validation; ``index`` is index_graph(nodes, edges).
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
    held: Held | None = None,
) -> None:
    """steps.parquet -> out_dir/{metrics_graph, nodes, edges}.parquet (embedding cache: out_dir/cache)."""
    _graph_stage(
        steps_path, out_dir, out_dir / "cache" / "embeddings.parquet", config, iteration, require_stamp, held
    )


def _graph_stage(
    steps_path: Path,
    folder: Path,
    cache: Path,
    config: Config,
    iteration: int,
    require_stamp: bool,
    held: Held | None = None,
) -> None:
    t0 = time.perf_counter()
    held = held if held is not None else Held()
    steps = held.steps
    if steps is None:
        steps = read_table(steps_path, "steps", require_stamp=require_stamp)
        validate_steps(steps, source=str(steps_path))
    embedder = make_embedder(config, cache)
    nodes, edges = graph_of(steps, config, embedder)
    index = index_graph(nodes, edges) if nodes.height else None
    metrics = {
        **graph_metrics(nodes, edges, index),
        **embed_metrics(embedder),
        "seconds": time.perf_counter() - t0,
    }
    write_metrics(folder, "graph", iteration, metrics, steps, (nodes, edges), index)
    write_table(nodes, "nodes", folder / "nodes.parquet")
    write_table(edges, "edges", folder / "edges.parquet")
    held.steps, held.nodes, held.edges, held.index, held.values = steps, nodes, edges, index, None


def solve_files(
    folder: Path,
    config: Config,
    iteration: int = 0,
    steps_path: Path | None = None,
    held: Held | None = None,
) -> None:
    """folder/{nodes, edges}.parquet -> folder/{metrics_solve, values}.parquet.

    ``steps_path`` (optional) adds per-task-type propagation rows to the metrics.
    """
    t0 = time.perf_counter()
    held = held if held is not None else Held()
    if held.nodes is None or held.edges is None:
        held.nodes = read_table(folder / "nodes.parquet", "nodes")
        held.edges = read_table(folder / "edges.parquet", "edges")
        held.index = None
    nodes, edges = held.nodes, held.edges
    index = held.index if held.index is not None else index_graph(nodes, edges)
    values = values_of(nodes, edges, config, index)
    metrics = {**solve_metrics(values, edges, index), "seconds": time.perf_counter() - t0}
    steps = held.steps
    if steps is None and steps_path is not None and steps_path.is_file():
        steps = read_table(steps_path, "steps", require_stamp=False).select("group_id", "task_type")
    write_metrics(folder, "solve", iteration, metrics, steps, (values, edges), index)
    write_table(values, "values", folder / "values.parquet")
    held.index, held.values = index, values


def advantage_files(
    steps_path: Path,
    folder: Path,
    config: Config,
    iteration: int = 0,
    require_stamp: bool = True,
    held: Held | None = None,
) -> None:
    """steps + folder/{nodes, edges, values} -> folder/{metrics_advantage, advantages}.parquet."""
    t0 = time.perf_counter()
    held = held if held is not None else Held()
    steps = held.steps
    if steps is None:
        steps = read_table(steps_path, "steps", require_stamp=require_stamp)
    if held.nodes is None or held.edges is None:
        held.nodes = read_table(folder / "nodes.parquet", "nodes")
        held.edges = read_table(folder / "edges.parquet", "edges")
        held.index = None
    if held.values is None:
        held.values = read_table(folder / "values.parquet", "values")
    adv = compute_advantages(
        steps,
        held.nodes,
        held.edges,
        held.values,
        config.advantage,
        config.solve.gamma,
        index=held.index,
        step_rewards=config.solve.step_rewards,
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
