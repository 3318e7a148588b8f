"""``graft graph``, ``graft solve``, ``graft advantage``: the credit stages, on a run or on plain files.

On a run (a directory with config.toml)::

    graft graph RUN --iter 3            # iter_0003/steps.parquet -> nodes, edges (+ metrics_graph)
    graft solve RUN --iter 3            # -> values (+ metrics_solve)
    graft advantage RUN --iter 3        # -> advantages (+ metrics_advantage); runs missing stages first

On files (external rollouts; the steps file may lack graft metadata)::

    graft graph STEPS.parquet -o OUT_DIR
    graft solve OUT_DIR
    graft advantage STEPS.parquet -o OUT_DIR --set advantage.estimator=grpo

Options come from config keys: ``--config FILE`` (files only) and ``--set key=value`` (both).
"""

from __future__ import annotations

from pathlib import Path

import typer

from graft_cli.commands.confirm import YES_OPTION, print_removed, stage_command
from schemas.errors import GraftError

# options shared by the three commands (typer reads them when a command is registered)
_ITER_OPTION = typer.Option(None, "--iter", help="Iteration (runs only).")
_OUT_OPTION = typer.Option(None, "-o", "--out", help="Output directory (files only).")
_CONFIG_OPTION = typer.Option(None, "--config", help="Config TOML (files only).")
_FORCE_OPTION = typer.Option(
    False, "--force", help="Recompute a finished stage of a run and remove what was computed from it."
)
_SET_OPTION = typer.Option(
    [], "--set", help="Config override KEY=VALUE, e.g. graph.canonicalize=similarity (repeatable)."
)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("graph")(graph)
    app.command("solve")(solve)
    app.command("advantage")(advantage)


def _is_run(target: Path) -> bool:
    return target.is_dir() and (target / "config.toml").is_file()


def _summary(folder: Path, stage: str, names: tuple[str, ...]) -> str:
    """``<stage>: name=value, ...`` from the metrics rows the stage just wrote (over all task types)."""
    import polars as pl

    from schemas import read_table

    rows = read_table(folder / f"metrics_{stage}.parquet", "metrics").filter(pl.col("task_type").is_null())
    values = dict(zip(rows["name"].to_list(), rows["value"].to_list(), strict=True))
    shown = [f"{n}={values[n]:.4g}" for n in names if n in values]
    return f"{stage}: " + ", ".join(shown) + (f" ({values['seconds']:.2f} s)" if "seconds" in values else "")


def _run_context(
    target: Path, iteration: int | None, config_path: Path | None, overrides: list[str], command: str
):
    from schemas.rundir import open_run

    if config_path is not None:
        raise GraftError(
            f"{command}: {target} is a run and uses its own config.toml; use --set to override keys"
        )
    if iteration is None:
        raise GraftError(f"{command}: give --iter I for run {target}")
    if iteration < 0:
        raise GraftError(f"{command}: --iter must be >= 0, got {iteration}")
    run = open_run(target)
    return run, run.load_config(overrides), iteration


def _file_config(config_path: Path | None, overrides: list[str]):
    from schemas.config import load_config

    return load_config(config_path, overrides)


def _steps_file(target: Path, command: str) -> Path:
    if target.is_dir():
        raise GraftError(
            f"{command}: {target} is a directory without config.toml (not a run); give a steps .parquet file"
        )
    if not target.is_file():
        raise GraftError(f"{command}: {target}: file not found")
    return target


def _out_dir(out: Path | None, command: str) -> Path:
    if out is None:
        raise GraftError(f"{command}: give -o OUT_DIR for the output tables")
    if out.exists() and not out.is_dir():
        raise GraftError(f"{command}: {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def graph(
    target: Path = typer.Argument(..., help="Run directory, or a steps .parquet file."),
    iteration: int | None = _ITER_OPTION,
    out: Path | None = _OUT_OPTION,
    config_path: Path | None = _CONFIG_OPTION,
    overrides: list[str] = _SET_OPTION,
    force: bool = _FORCE_OPTION,
    yes: bool = YES_OPTION,
) -> None:
    """Build the trajectory graphs: steps -> nodes.parquet, edges.parquet."""
    from stages.credit import graph_chain

    if _is_run(target):
        from stages.loop import run_stage

        run, config, it = _run_context(target, iteration, config_path, overrides, "graph")
        done = run_stage(run, "graph", it, config, command=stage_command(force, yes, overrides))
        print_removed(run, it, done.removed)
        folder = run.iter_dir(it)
    else:
        steps = _steps_file(target, "graph")
        folder = _out_dir(out, "graph")
        graph_chain(steps, folder, _file_config(config_path, overrides))
    typer.echo(_summary(folder, "graph", ("groups", "nodes", "edges", "mean_node_group_size")))
    typer.echo(f"wrote {folder / 'nodes.parquet'}, {folder / 'edges.parquet'}")


def solve(
    target: Path = typer.Argument(..., help="Run directory, or a directory holding nodes/edges.parquet."),
    iteration: int | None = _ITER_OPTION,
    config_path: Path | None = _CONFIG_OPTION,
    overrides: list[str] = _SET_OPTION,
    force: bool = _FORCE_OPTION,
    yes: bool = YES_OPTION,
) -> None:
    """Bellman values on the graphs: nodes, edges -> values.parquet."""
    from stages.credit import solve_chain

    if _is_run(target):
        from stages.loop import run_stage

        run, config, it = _run_context(target, iteration, config_path, overrides, "solve")
        done = run_stage(run, "solve", it, config, command=stage_command(force, yes, overrides))
        print_removed(run, it, done.removed)
        folder = run.iter_dir(it)
    else:
        if not target.is_dir():
            raise GraftError(
                f"solve: {target} is not a directory (give the graph's output directory or a run)"
            )
        folder = target
        missing = [n for n in ("nodes.parquet", "edges.parquet") if not (folder / n).is_file()]
        if missing:
            raise GraftError(
                f"solve: {folder} has no {' or '.join(missing)}; run graft graph STEPS.parquet -o {folder} first"
            )
        solve_chain(folder, _file_config(config_path, overrides))
    typer.echo(
        _summary(folder, "solve", ("sweeps_max", "residual_max", "propagation_mean", "share_nodes_no_end"))
    )
    typer.echo(f"wrote {folder / 'values.parquet'}")


def advantage(
    target: Path = typer.Argument(..., help="Run directory, or a steps .parquet file."),
    iteration: int | None = _ITER_OPTION,
    out: Path | None = _OUT_OPTION,
    config_path: Path | None = _CONFIG_OPTION,
    overrides: list[str] = _SET_OPTION,
    force: bool = _FORCE_OPTION,
    yes: bool = YES_OPTION,
) -> None:
    """Step advantages: steps -> advantages.parquet (graph and values rebuilt when missing or stale).

    Stale: built from another steps file or another graph/solve config.
    """
    from stages.credit import advantage_chain
    from stages.credit.advantage.registry import get_estimator

    if _is_run(target):
        from stages.loop.commands import advantage_on_run

        run, config, it = _run_context(target, iteration, config_path, overrides, "advantage")
        removed = advantage_on_run(run, it, config, stage_command(force, yes, overrides))
        print_removed(run, it, removed)
        folder = run.iter_dir(it)
    else:
        steps = _steps_file(target, "advantage")
        folder = _out_dir(out, "advantage")
        config = _file_config(config_path, overrides)
        get_estimator(config.advantage.estimator)  # unknown names fail before any work
        advantage_chain(steps, folder, config)
    typer.echo(
        _summary(
            folder,
            "advantage",
            ("advantage_mean", "advantage_std", "advantage_abs_mean", "norm_group_size_mean"),
        )
    )
    typer.echo(f"wrote {folder / 'advantages.parquet'}")
