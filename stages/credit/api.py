"""GRAFT step credit from Python: the functions ``from stages import credit`` offers (see the package
docstring), and the helpers the stage runners share with them.

``graph`` / ``solve`` / ``advantages`` take their settings as arguments and validate their input;
``graph_from_config`` / ``values_from_config`` take a ``Config``'s ``[graph]`` / ``[solve]`` sections
and trust an input validated before (``run_all``, the stage runners)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from schemas import conform, validate_steps
from schemas.config import AdvantageConfig, Config
from schemas.errors import GraftError
from schemas.metrics import metrics_frame
from stages.credit.advantage.compute import compute_advantages
from stages.credit.bellman import GraphIndex, index_graph, solve_values
from stages.credit.diagnostics import graph_metrics, solve_metrics
from stages.credit.trajectory_graph import Embedder, build_graph


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
    from stages.credit.embed import SentenceEncoder

    return SentenceEncoder(
        config.graph.embed_model, config.graph.embed_batch, cache, config.graph.long_states
    )


def graph_from_config(
    steps: pl.DataFrame, config: Config, embedder: Embedder | None = None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """build_graph with the ``[graph]`` settings of ``config`` (embedder: make_embedder's when None)."""
    g = config.graph
    embedder = embedder if embedder is not None else make_embedder(config)
    return build_graph(steps, g.canonicalize, g.tau, g.truncation, embedder, g.time_key)


def values_from_config(
    nodes: pl.DataFrame, edges: pl.DataFrame, config: Config, index: GraphIndex
) -> pl.DataFrame:
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
    """(nodes, edges) of every group's trajectory graph; see stages.credit.trajectory_graph.build_graph."""
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
    """Values table (Bellman fixed point per node); see stages.credit.bellman.solve_values."""
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
    oracle: pl.DataFrame | None = None,
    **options: Any,
) -> pl.DataFrame:
    """Advantages table for ``steps``; graph and values are computed when not given.

    ``config``: a full Config (graph/solve/advantage sections used) or an AdvantageConfig; keyword
    ``options`` override AdvantageConfig fields (``estimator="grpo"``, ``lam=0.6``, ...);
    ``gamma`` and ``step_rewards`` override solve.gamma and solve.step_rewards. ``oracle``: the
    ``oracle`` table the bench oracle estimator reads (stages.credit.advantage.oracle).
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
        nodes, edges = graph_from_config(steps, full)
    if values is None:
        values = solve_values(nodes, edges, gamma, full.solve.eps, step_rewards=step_rewards)
    return compute_advantages(
        steps, nodes, edges, values, adv, gamma, step_rewards=step_rewards, oracle=oracle
    )


def run_all(
    steps: pl.DataFrame, config: Config | None = None, embedder: Embedder | None = None
) -> CreditTables:
    """Validate ``steps``, then graph -> solve -> advantage with ``config`` (default Config())."""
    config = config or Config()
    steps = _as_steps(steps, "<steps>")
    t0 = time.perf_counter()
    embedder = embedder or make_embedder(config)
    nodes, edges = graph_from_config(steps, config, embedder)
    t1 = time.perf_counter()
    index = index_graph(nodes, edges)
    values = values_from_config(nodes, edges, config, index)
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
