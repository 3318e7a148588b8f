"""GRAFT step credit from Python, and the graph / solve / advantage stage runners.

For people who bring their own rollouts (a steps table per docs/design.md §3, e.g. converted from verl-agent
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

Modules: ``trajectory_graph`` (steps -> nodes, edges), ``embed`` (sentence embeddings of similarity
states), ``bellman`` (the values of the graph's nodes), ``advantage/`` (the estimator registry and its
estimators), ``diagnostics`` (graph and solve metrics rows), ``synth`` (synthetic MDP rollouts),
``api`` (the functions above), ``runners`` (the stage runners and the file-mode stages),
``file_mode`` (the file-mode chain: which tables of an output folder are stale, rebuilt in one call).

Two ways to name the settings, kept apart: ``graph``, ``solve`` and ``advantages`` take them as
keyword arguments and validate their input (the Python API); ``api.graph_from_config`` and
``api.values_from_config`` read them from a ``Config``'s sections and trust their input (what
``run_all`` and the stage runners use after validating once) and are not exported here.
"""

from stages.credit.api import (
    CreditTables,
    advantage_metrics,
    advantages,
    embed_metrics,
    graph,
    make_embedder,
    run_all,
    solve,
)
from stages.credit.file_mode import advantage_chain, graph_chain, solve_chain
from stages.credit.runners import (
    ChainTables,
    advantage_files,
    graph_files,
    run_advantage,
    run_graph,
    run_solve,
    solve_files,
    write_metrics,
)
from stages.credit.synth import synth_steps

__all__ = [
    "CreditTables",
    "ChainTables",
    "advantage_chain",
    "advantage_files",
    "advantage_metrics",
    "advantages",
    "embed_metrics",
    "graph",
    "graph_chain",
    "graph_files",
    "make_embedder",
    "run_advantage",
    "run_all",
    "run_graph",
    "run_solve",
    "solve",
    "solve_chain",
    "solve_files",
    "synth_steps",
    "write_metrics",
]
