"""Read-only SQL over a run directory (docs/design.md §8 ``graft sql``).

One in-memory DuckDB connection, one view per graft table spanning all iterations:

    steps, nodes, edges, "values", advantages, metrics, eval, eval_episodes, update (+ reflogprobs, truth when present)

Each view reads ``RUN/iter_*/<table>.parquet`` lazily (``metrics`` reads ``metrics*.parquet``, one file
per stage) plus a ``RUN/<table>.parquet`` at the top (e.g. a ``graft synth`` output directory), and
has an ``iter`` column taken from the ``iter_NNNN`` directory name (the directory wins over a table's
own ``iter`` column; top-level files keep their own, e.g. the initial evaluation's ``iter = -1``; a
top-level table without one, e.g. ``advantages`` written with ``-o``, takes the single iteration of
the top-level metrics/steps there, else null). Quoting ``"values"`` is safest (an SQL keyword elsewhere).
A run with a warm start also gets ``sft_metrics``, ``sft_update``, ``demos`` (the expert's demos) and
``dagger_steps`` (every DAgger round's relabelled turns, with ``round``) from ``RUN/sft/``.

Read-only: only one SELECT / WITH / VALUES / FROM statement is accepted; COPY, EXPORT, ATTACH,
INSTALL/LOAD, SET, PRAGMA, CREATE ... are refused before anything runs, and once the views exist the
connection loses file access outside the run directory (``enable_external_access = false`` with the
run as the only allowed directory) and its configuration is locked.

DuckDB also allows its temp directory, by default ``<cwd>/.tmp`` -- which a run directory could ship as
a symlink to ``/``. So the temp directory is set, before the lock, to a fresh private directory
(``tempfile.mkdtemp``, mode 0700, deleted afterwards): spilling still works and nothing else is
reachable through it. A run holding a symlink that resolves outside the run is refused outright.

DuckDB does not verify Parquet page checksums, so before it sees a run every file a view covers is
read once with pyarrow's verification (schemas.verified: cached by file identity); a damaged byte is
an error naming the file, never a different number. A finished iteration is first checked against its
manifest (schemas/manifest.py), so a table swapped in from elsewhere, a footer change that renames a
column or a deleted table is refused too.
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import polars as pl

from schemas.confine import refuse_links_out
from schemas.definitions import TABLES
from schemas.errors import GraftError
from schemas.manifest import verify_finished
from schemas.rundir import Run
from schemas.verified import verify_tables

# View name -> file name pattern inside an iteration directory (metrics: one file per stage).
VIEW_FILES: dict[str, str] = {name: f"{name}.parquet" for name in TABLES} | {"metrics": "metrics*.parquet"}
# The warm start's tables (graft sft, <run>/sft/): view -> file pattern relative to the run
WARM_START_VIEWS: dict[str, str] = {
    "sft_metrics": "sft/metrics_sft.parquet",
    "sft_update": "sft/update.parquet",
    "demos": "sft/demos/steps.parquet",
    "dagger_steps": "sft/dagger/round_*/steps.parquet",  # with a ``round`` column from the folder
}
_MISSING_TABLE = re.compile(r"Table with name (\w+) does not exist", re.IGNORECASE)


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _table_patterns(view: str) -> list[str]:
    """Glob patterns of a view's files, relative to the run."""
    if view in WARM_START_VIEWS:
        return [WARM_START_VIEWS[view]]
    return [f"iter_[0-9]*/{VIEW_FILES[view]}", VIEW_FILES[view]]


GLOB_CHARACTERS = re.compile(r"[\[\]*?{}]")


def table_globs(root: Path) -> dict[str, list[str]]:
    """For each view, the DuckDB glob patterns that match at least one file in the run (others omitted)."""
    found: dict[str, list[str]] = {}
    base = str(root.resolve())
    for view in [*VIEW_FILES, *WARM_START_VIEWS]:
        hits = [f"{base}/{p}" for p in _table_patterns(view) if any(f.is_file() for f in root.glob(p))]
        if hits:
            found[view] = hits
    return found


def table_files(root: Path, views: list[str]) -> list[Path]:
    """Every file the given views read (what ``graft sql`` verifies before DuckDB sees it)."""
    return sorted({f for v in views for p in _table_patterns(v) for f in root.glob(p) if f.is_file()})


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


def _warm_start_view_sql(view: str, globs: list[str]) -> str:
    files = "[" + ", ".join(_literal(g) for g in globs) + "]"
    source = f"read_parquet({files}, filename = true, union_by_name = true)"
    extra = ""
    if view == "dagger_steps":
        extra = r", TRY_CAST(regexp_extract(filename, '/round_(\d+)/[^/]*$', 1) AS INTEGER) AS round"
    return f"CREATE VIEW {_quote(view)} AS SELECT * EXCLUDE (filename){extra} FROM {source}"


def _view_sql(view: str, globs: list[str], top_iter: int | None = None) -> str:
    if view in WARM_START_VIEWS:
        return _warm_start_view_sql(view, globs)
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


def connect(
    run_dir: str | Path, temp_dir: str | Path | None = None, memory_limit: str | None = None
) -> tuple[duckdb.DuckDBPyConnection, dict[str, list[str]]]:
    """Open an in-memory, locked-down DuckDB connection with one view per table the run has.

    ``temp_dir`` is where DuckDB may spill (a private directory; None = no spilling at all);
    ``memory_limit`` (e.g. ``"64MB"``) caps DuckDB's memory before the configuration is locked.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise GraftError(f"{root}: run directory not found")
    if GLOB_CHARACTERS.search(str(root.resolve())):
        # DuckDB reads every file path as a pattern and checks allowed directories on the pattern: a
        # run at "b*c" would also read "bXc", one at "a[1]" only "a1". Refused rather than misread.
        raise GraftError(
            f"{root}: graft sql needs a run path without [ ] * ? {{ }} (DuckDB reads them as a file "
            "pattern); rename the directory, or copy the run to such a path"
        )
    refuse_links_out(root, "graft sql reads")
    globs = table_globs(root)
    if not globs:
        raise GraftError(f"{root}: no graft tables found (expected iter_NNNN/<table>.parquet files)")
    # a finished iteration is served only as its manifest records it (a swapped, renamed or deleted
    # table is refused); DuckDB does not check Parquet page CRCs: every file a view can read is
    # verified first (both cached by file identity, so a second query reads nothing again)
    verify_finished(Run(root))
    verify_tables(table_files(root, list(globs)))
    con = duckdb.connect(":memory:")
    try:
        # before anything else: DuckDB's default temp directory <cwd>/.tmp is an allowed directory
        con.execute(f"SET temp_directory = {_literal(str(temp_dir) if temp_dir is not None else '')}")
        if memory_limit is not None:
            con.execute(f"SET memory_limit = {_literal(memory_limit)}")
        top_iter = top_level_iteration(root)
        for view, patterns in globs.items():
            con.execute(_view_sql(view, patterns, top_iter))
        con.execute(f"SET allowed_directories = [{_literal(str(root.resolve()) + '/')}]")
        con.execute("SET autoinstall_known_extensions = false")  # never download an extension
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise GraftError(f"{root}: cannot open the run's tables ({_one_line(exc)})") from None
    return con, globs


@contextmanager
def private_temp_dir() -> Iterator[Path]:
    """A fresh directory only this process can use, deleted afterwards (DuckDB's spill space)."""
    path = Path(tempfile.mkdtemp(prefix="graft-sql-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _execute(con: duckdb.DuckDBPyConnection, query: str, timeout: float | None) -> pl.DataFrame:
    """Run ``query`` in a worker thread while this (main) thread waits, so that a Ctrl-C or the
    timeout reaches DuckDB through ``con.interrupt()`` (DuckDB's own SIGINT check can miss a
    signal). A timeout is a GraftError; a Ctrl-C re-raises KeyboardInterrupt once the query stopped."""
    outcome: dict[str, object] = {}
    done = threading.Event()  # not Thread.join: a join cut short by KeyboardInterrupt can lie (3.11)

    def work() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # Ctrl-C is the waiting thread's
        try:
            outcome["frame"] = con.sql(query).pl()
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name="graft-sql", daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # short waits: the signal flag is checked between them whichever thread the kernel woke
        while not done.is_set() and (deadline is None or time.monotonic() < deadline):
            done.wait(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
    except KeyboardInterrupt:
        con.interrupt()
        done.wait()
        raise
    if not done.is_set():
        con.interrupt()
        done.wait()
        if "frame" not in outcome:
            raise GraftError(f"sql: query stopped after --timeout {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["frame"]  # type: ignore[return-value]


def run_query(
    run_dir: str | Path, query: str, timeout: float | None = None, memory_limit: str | None = None
) -> pl.DataFrame:
    """Run one read-only query over the run's views and return the result as a polars DataFrame.

    ``timeout`` (seconds) interrupts a query still running then (a GraftError); a Ctrl-C during the
    query raises KeyboardInterrupt.
    """
    if timeout is not None and not timeout > 0:
        raise GraftError(f"sql: --timeout must be > 0 seconds, got {timeout}")
    check_read_only(query)
    with private_temp_dir() as temp_dir:
        con, globs = connect(run_dir, temp_dir, memory_limit)
        try:
            return _execute(con, query, timeout)
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
