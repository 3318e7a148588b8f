"""Read-only SQL over a run directory (SPEC §8 ``graft sql``).

One in-memory DuckDB connection, one view per graft table spanning all iterations:

    steps, nodes, edges, "values", advantages, metrics, eval, update (+ reflogprobs, truth when present)

Each view reads ``RUN/iter_*/<table>.parquet`` lazily (``metrics`` reads ``metrics*.parquet``, one file
per stage) plus a ``RUN/<table>.parquet`` at the top (e.g. a ``graft synth`` output directory), and
has an ``iter`` column taken from the ``iter_NNNN`` directory name (the directory wins over a table's
own ``iter`` column; top-level files keep their own, e.g. the initial evaluation's ``iter = -1``; a
top-level table without one, e.g. ``advantages`` written with ``-o``, takes the single iteration of
the top-level metrics/steps there, else null). Quoting ``"values"`` is safest (an SQL keyword elsewhere).

Read-only: only one SELECT / WITH / VALUES / FROM statement is accepted; COPY, EXPORT, ATTACH,
INSTALL/LOAD, SET, PRAGMA, CREATE ... are refused before anything runs, and once the views exist the
connection loses file access outside the run directory (``enable_external_access = false`` with the
run as the only allowed directory) and its configuration is locked.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import polars as pl

from schemas.definitions import TABLES
from schemas.errors import GraftError

# View name -> file name pattern inside an iteration directory (metrics: one file per stage).
VIEW_FILES: dict[str, str] = {name: f"{name}.parquet" for name in TABLES} | {"metrics": "metrics*.parquet"}
_MISSING_TABLE = re.compile(r"Table with name (\w+) does not exist", re.IGNORECASE)


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def table_globs(root: Path) -> dict[str, list[str]]:
    """For each view, the glob patterns that match at least one file in the run (others omitted)."""
    found: dict[str, list[str]] = {}
    for view, pattern in VIEW_FILES.items():
        patterns = [f"iter_[0-9]*/{pattern}", pattern]
        hits = [str(root.resolve() / p) for p in patterns if any(f.is_file() for f in root.glob(p))]
        if hits:
            found[view] = hits
    return found


def top_level_iteration(root: Path) -> int | None:
    """The one iteration the top-level tables of ``root`` belong to, or None.

    Files written with ``-o`` (``graft graph/solve/advantage STEPS -o OUT``) sit at the top of OUT;
    nodes, edges, values and advantages have no ``iter`` column of their own, while the metrics (and
    a steps file) there do. When those agree on a single iteration, the iter-less tables take it.
    """
    files = [f for pattern in ("metrics*.parquet", "steps.parquet") for f in sorted(root.glob(pattern))]
    seen: set[int] = set()
    for path in files:
        try:
            column = pl.scan_parquet(path).select(pl.col("iter").unique()).collect()["iter"]
        except Exception:  # unreadable or without iter: the view reports real problems when queried
            continue
        seen.update(int(v) for v in column.drop_nulls().to_list())
    return seen.pop() if len(seen) == 1 else None


def _view_sql(view: str, globs: list[str], top_iter: int | None = None) -> str:
    files = "[" + ", ".join(_literal(g) for g in globs) + "]"
    dir_iter = r"TRY_CAST(regexp_extract(filename, '/iter_(\d+)/[^/]*$', 1) AS INTEGER)"
    source = f"read_parquet({files}, filename = true, union_by_name = true)"
    if "iter" in TABLES[view].column_names:
        # the directory names the iteration; a top-level file keeps its own iter column
        select = f"SELECT * EXCLUDE (filename) REPLACE (COALESCE({dir_iter}, iter)::INTEGER AS iter)"
    else:
        fallback = "NULL" if top_iter is None else str(int(top_iter))
        select = f"SELECT COALESCE({dir_iter}, {fallback})::INTEGER AS iter, * EXCLUDE (filename)"
    return f"CREATE VIEW {_quote(view)} AS {select} FROM {source}"


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def check_read_only(query: str) -> None:
    """Refuse anything but a single SELECT-like statement (parsed by DuckDB, nothing executed)."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise GraftError(f"sql: {_hint(_one_line(exc), query)}") from None
    if len(statements) != 1:
        raise GraftError(f"sql: expected exactly one statement, got {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        name = getattr(kind, "name", str(kind))
        raise GraftError(f"sql: only SELECT / WITH queries are allowed (read-only); got a {name} statement")


def _hint(message: str, query: str) -> str:
    if re.search(r"\bvalues\b", query, re.IGNORECASE) and "syntax error" in message.lower():
        return f'{message} (the values table is an SQL keyword: write "values")'
    return message


def connect(run_dir: str | Path) -> tuple[duckdb.DuckDBPyConnection, dict[str, list[str]]]:
    """Open an in-memory, locked-down DuckDB connection with one view per table the run has."""
    root = Path(run_dir)
    if not root.is_dir():
        raise GraftError(f"{root}: run directory not found")
    globs = table_globs(root)
    if not globs:
        raise GraftError(f"{root}: no graft tables found (expected iter_NNNN/<table>.parquet files)")
    con = duckdb.connect(":memory:")
    try:
        top_iter = top_level_iteration(root)
        for view, patterns in globs.items():
            con.execute(_view_sql(view, patterns, top_iter))
        con.execute(f"SET allowed_directories = [{_literal(str(root.resolve()) + '/')}]")
        con.execute("SET autoinstall_known_extensions = false")  # never download an extension
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise GraftError(f"{root}: cannot open the run's tables ({_one_line(exc)})") from None
    return con, globs


def run_query(run_dir: str | Path, query: str) -> pl.DataFrame:
    """Run one read-only query over the run's views and return the result as a polars DataFrame."""
    check_read_only(query)
    con, globs = connect(run_dir)
    try:
        return con.sql(query).pl()
    except duckdb.Error as exc:
        message = _one_line(exc)
        missing = _MISSING_TABLE.search(message)
        if missing and missing.group(1).lower() in VIEW_FILES:
            table = missing.group(1).lower()
            have = ", ".join(globs) or "none"
            raise GraftError(
                f"{run_dir}: the run has no {table} table (no iter_*/{VIEW_FILES[table]} files); "
                f"tables in this run: {have}"
            ) from None
        raise GraftError(f"sql: {_hint(message, query)}") from None
    finally:
        con.close()
