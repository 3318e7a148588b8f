"""Foundation commands: ``graft synth``, ``graft schema``, ``graft sql``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from schemas.errors import GraftError

if TYPE_CHECKING:  # polars and rich load when a command runs, not for --help
    import polars as pl


def synth(
    out_dir: Path = typer.Argument(..., help="Directory to write steps.parquet (and truth.parquet) into."),
    groups: int = typer.Option(8, "--groups", help="Rollout groups (one random MDP each)."),
    group_size: int = typer.Option(8, "--group-size", help="Rollouts per group (N)."),
    horizon: int = typer.Option(8, "--horizon", help="Max turns per episode."),
    width: int = typer.Option(4, "--width", help="Positions per layer of the state space."),
    merge: float = typer.Option(0.5, "--merge", help="Share of shared (hub) states where rollouts meet."),
    cycles: float = typer.Option(
        0.1,
        "--cycles",
        help="Probability an edge goes back to an earlier state (ignored with --truth: layered MDPs are acyclic).",
    ),
    invalid_rate: float = typer.Option(
        0.1, "--invalid-rate", help="Policy probability of an invalid action."
    ),
    invalid_penalty: float = typer.Option(
        -0.1, "--invalid-penalty", help="Step reward of an invalid action."
    ),
    truncation: float = typer.Option(0.1, "--truncation", help="Probability a last-turn edge is cut."),
    gamma: float = typer.Option(1.0, "--gamma", help="Discount of the exact truth values."),
    success_reward: float = typer.Option(1.0, "--success-reward", help="Outcome of reaching the goal."),
    seed: int = typer.Option(0, "--seed", help="Random seed (MDPs and rollouts)."),
    truth: bool = typer.Option(
        False, "--truth", help="Layered MDPs; also write exact V/Q/A (truth.parquet)."
    ),
) -> None:
    """Write synthetic group rollouts of random sparse-reward MDPs as a steps table."""
    from schemas.config import check_seed

    check_seed(seed)
    import polars as pl

    from stages.credit.synth import write_synth

    paths = write_synth(
        out_dir, groups=groups, group_size=group_size, horizon=horizon, width=width, merge=merge,
        cycles=cycles, invalid_rate=invalid_rate, invalid_penalty=invalid_penalty, truncation=truncation,
        gamma=gamma, success_reward=success_reward, seed=seed, truth=truth,
    )  # fmt: skip
    for path in paths:
        rows = pl.scan_parquet(path).select(pl.len()).collect().item()
        typer.echo(f"wrote {path} ({rows} rows)")


def schema(
    table: str = typer.Argument(
        None, help="Table to describe (or 'config': every setting with its tier); omit to list all tables."
    ),
    config: Path = typer.Option(None, "--config", help="With 'config': the values of this config file."),
    overrides: list[str] = typer.Option([], "--set", help="With 'config': KEY=VALUE over the config."),
) -> None:
    """Print the graft tables, or one table's columns with their types and meaning; ``schema config``
    prints every setting with its default and its tier (paper, default, experimental, legacy)."""
    from rich.console import Console
    from rich.table import Table

    from schemas import TABLES
    from schemas.definitions import steps_column_role

    console = Console(width=max(Console().width, 110))
    if table == "config":
        settings_table(console, config, overrides)
        return
    if config is not None or overrides:
        raise GraftError("--config and --set go with 'graft schema config' only")
    if table is None:
        out = Table(title="graft tables")
        for col in ("table", "version", "description"):
            out.add_column(col)
        for spec in TABLES.values():
            out.add_row(spec.name, str(spec.version), spec.description)
        console.print(out)
        return
    if table not in TABLES:
        raise GraftError(f"unknown table '{table}'; tables: {', '.join(TABLES)}")
    spec = TABLES[table]
    out = Table(title=f"{spec.name} (v{spec.version}): {spec.description}")
    roles = table == "steps"
    for col in ("column", "type", "nullable", *(["in an external table"] if roles else []), "meaning"):
        out.add_column(col)
    for c in spec.columns:
        role = [steps_column_role(c.name)] if roles else []
        out.add_row(c.name, str(c.type), "yes" if c.nullable else "no", *role, c.meaning)
    console.print(out)
    if roles:
        console.print(
            "required (credit): graft graph/solve/advantage need these; default X: may be absent, "
            "filled with X; training only: the update needs them (absent = null); optional: may be absent."
        )


def settings_table(console: Any, config_path: Path | None, overrides: list[str]) -> None:
    """Every setting: its default, its tier, the tiers of its other values, and -- with a config --
    the config's value and that value's tier (experimental and legacy values marked)."""
    from rich.table import Table

    from schemas.config import EXPERIMENTAL, LEGACY, load_config, setting_tiers, tier_of

    chosen = load_config(config_path, overrides) if config_path is not None or overrides else None
    out = Table(title="settings and their tiers (docs/options.md)")
    columns = ("setting", "default", "tier", "other values", *(["value", "its tier"] if chosen else []))
    for col in columns:
        out.add_column(col, overflow="fold")  # a setting's name is never cut
    marked = []
    for key, default, tier, others in setting_tiers():
        if isinstance(others, dict):
            other = ", ".join(f"{value!r}: {value_tier}" for value, value_tier in others.items())
        else:
            other = f"any: {others}" if others else ""
        row = [key, repr(default), tier, other]
        if chosen is not None:
            value = chosen.to_dict()
            for part in key.split("."):
                value = value[part]
            value_tier = tier_of(key, value)
            row += [repr(value), value_tier]
            if value_tier in (EXPERIMENTAL, LEGACY):
                marked.append(f"{key} = {value!r} ({value_tier})")
        out.add_row(*row)
    console.print(out)
    if chosen is not None:
        console.print("experimental or legacy values in use: " + (", ".join(marked) if marked else "none"))


def sql(
    run: Path = typer.Argument(..., help="Run directory."),
    query: str = typer.Argument(..., help='One SELECT/WITH query over steps, nodes, edges, "values", ...'),
    fmt: str = typer.Option("table", "--format", help="Output format: table | csv | json."),
    timeout: float = typer.Option(
        None, "--timeout", help="Stop the query after this many seconds (default: no limit)."
    ),
) -> None:
    """Query every table of a run with DuckDB (read-only; one view per table, all iterations)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from stages.observe.sql import run_query

    if fmt not in ("table", "csv", "json"):
        raise GraftError(f"--format '{fmt}': expected table, csv or json")
    result = run_query(run, query, timeout=timeout)
    if fmt == "csv":
        sys.stdout.write(_nested_to_text(result).write_csv())
    elif fmt == "json":
        sys.stdout.write(_json(result.to_dicts()) + "\n")
    else:
        # cells are data, not markup: Text() keeps "[b]" and ":x:" literal; control characters are
        # shown escaped so that no cell can send ESC sequences to the terminal
        out = Table(show_lines=False)
        for name, dtype in result.schema.items():
            out.add_column(Text(literal_cell(name)), justify="right" if dtype.is_numeric() else "left")
        for row in _nested_to_text(result).iter_rows():
            out.add_row(*(Text("null" if v is None else literal_cell(str(v))) for v in row))
        Console(width=max(Console().width, 110)).print(out)
        typer.echo(f"{result.height} row(s)")


def literal_cell(text: str) -> str:
    """``text`` with every control character and bidirectional override written as an escape."""
    from graft_cli.commands.printable import printable

    return printable(text)


def _nested_to_text(frame: pl.DataFrame) -> pl.DataFrame:
    """CSV has no nested types: write list/struct columns as JSON text."""
    import polars as pl

    nested = [n for n, t in frame.schema.items() if t.is_nested()]
    if not nested:
        return frame
    return frame.with_columns(
        pl.Series(n, [None if v is None else _json(v) for v in frame[n].to_list()], dtype=pl.String)
        for n in nested
    )


def _finite_or_named(value: object) -> object:
    """JSON has no NaN or infinity: write them as the strings "NaN", "Infinity", "-Infinity" (polars
    writes NaN as null, which reads back as SQL NULL -- a different value)."""
    import math
    from decimal import Decimal

    if isinstance(value, Decimal):  # a SQL DECIMAL literal: a JSON number, as polars wrote it
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite_or_named(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_named(v) for v in value]
    return value


def _json(value: object) -> str:
    """Strict JSON (non-finite floats named, see ``_finite_or_named``; dates and others as text)."""
    import json

    return json.dumps(_finite_or_named(value), allow_nan=False, default=str)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("synth")(synth)
    app.command("schema")(schema)
    app.command("sql")(sql)
