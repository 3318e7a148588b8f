"""graft sql: views across iterations, output formats, read-only, one-line errors."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
import pytest

from graft_cli.app import app
from schemas import TABLES, write_table
from schemas.errors import GraftError
from schemas.rundir import Run
from stages.credit.synth import synth_steps
from stages.observe.sql import check_read_only, connect, private_temp_dir, run_query
from tests.helpers.paths import REPO


def _metrics(iteration: int, stage: str, names: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "iter": [iteration] * len(names),
            "stage": [stage] * len(names),
            "name": names,
            "value": [float(i) for i in range(len(names))],
            "task_type": [None] * len(names),
        },
        schema_overrides={"iter": pl.Int32, "task_type": pl.String},
    )


@pytest.fixture
def two_iter_run(new_run: Run) -> tuple[Run, dict[int, int]]:
    """A run with steps in iterations 0 and 1, metrics of two stages each, update rows, nodes in 0."""
    counts = {}
    for it in (0, 1):
        steps = synth_steps(groups=2 + it, group_size=4, seed=it)
        # iter column deliberately wrong in iteration 1: the directory name is what the view reports
        steps = steps.with_columns(pl.lit(7 if it else 0, pl.Int32).alias("iter"))
        new_run.write(it, "steps", steps)
        counts[it] = steps.height
        for stage, names in (("rollout", ["success_rate", "mean_return"]), ("graph", ["seconds"])):
            write_table(
                _metrics(it, stage, names), "metrics", new_run.iter_dir(it) / f"metrics_{stage}.parquet"
            )
        update = pl.DataFrame(
            {"iter": [it], "epoch": [-1], "minibatch": [-1], "name": ["loss"], "value": [0.5 + it]},
            schema_overrides={"iter": pl.Int32, "epoch": pl.Int32, "minibatch": pl.Int32},
        )
        new_run.write(it, "update", update)
    nodes = pl.DataFrame(
        {
            "group_id": ["g0"],
            "node": [0],
            "state": ["s"],
            "visits": [1],
            "out_edges": [1],
            "ends": [0],
            "end_value": [None],
        },
        schema_overrides={"end_value": pl.Float64},
    )
    new_run.write(0, "nodes", nodes)
    # a crashed writer's leftovers are not tables
    (new_run.iter_dir(1) / ".nodes.parquet.abc.tmp").write_bytes(b"garbage")
    (new_run.iter_dir(1) / ".metrics_update.parquet.abc.tmp").write_bytes(b"garbage")
    return new_run, counts


def test_views_span_iterations_with_iter_from_the_directory(two_iter_run):
    run, counts = two_iter_run
    per_iter = run_query(run.root, "SELECT iter, count(*) AS n FROM steps GROUP BY iter ORDER BY iter")
    assert per_iter.rows() == [(0, counts[0]), (1, counts[1])]
    assert run_query(run.root, "SELECT count(*) FROM nodes").item() == 1
    metrics = run_query(run.root, "SELECT iter, stage, count(*) n FROM metrics GROUP BY ALL ORDER BY ALL")
    assert metrics.rows() == [(0, "graph", 1), (0, "rollout", 2), (1, "graph", 1), (1, "rollout", 2)]
    update = run_query(run.root, "SELECT * FROM update ORDER BY iter")
    assert update.columns.count("iter") == 1
    assert update.select("iter", "value").rows() == [(0, 0.5), (1, 1.5)]
    joined = run_query(
        run.root,
        "WITH s AS (SELECT iter, avg(outcome) AS success FROM steps GROUP BY iter) "
        "SELECT s.iter, success, u.value AS loss FROM s JOIN update u USING (iter) ORDER BY s.iter",
    )
    assert joined.height == 2


def test_steps_view_has_the_schema_columns(two_iter_run):
    run, _ = two_iter_run
    columns = run_query(run.root, "SELECT * FROM steps LIMIT 1").columns
    assert sorted(columns) == sorted(TABLES["steps"].column_names)


def test_cli_csv_and_json_output(runner, two_iter_run):
    run, counts = two_iter_run
    query = "SELECT iter, count(*) AS n FROM steps GROUP BY iter ORDER BY iter"
    result = runner.invoke(app, ["sql", str(run.root), query, "--format", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert rows == [{"iter": "0", "n": str(counts[0])}, {"iter": "1", "n": str(counts[1])}]
    result = runner.invoke(app, ["sql", str(run.root), query, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"iter": 0, "n": counts[0]}, {"iter": 1, "n": counts[1]}]
    result = runner.invoke(app, ["sql", str(run.root), query])
    assert result.exit_code == 0
    assert "2 row(s)" in result.stdout and str(counts[1]) in result.stdout
    # nested columns become JSON text in CSV
    result = runner.invoke(
        app, ["sql", str(run.root), "SELECT [1, 2] AS ids, choices FROM steps LIMIT 1", "--format", "csv"]
    )
    assert result.exit_code == 0, result.output
    assert list(csv.reader(io.StringIO(result.stdout)))[1] == ["[1, 2]", ""]


def _error_line(runner, args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_errors_are_one_line_exit_2(runner, two_iter_run, tmp_path):
    run, _ = two_iter_run
    root = str(run.root)
    line = _error_line(runner, ["sql", str(tmp_path / "missing"), "SELECT 1"])
    assert "missing: run directory not found" in line
    line = _error_line(runner, ["sql", root, "SELECT * FROM advantages"])
    assert "the run has no advantages table" in line and "tables in this run: steps" in line
    line = _error_line(runner, ["sql", root, 'SELECT * FROM "values"'])
    assert "the run has no values table" in line
    line = _error_line(runner, ["sql", root, "SELEC * FROM steps"])
    assert "sql: Parser Error: syntax error" in line
    line = _error_line(runner, ["sql", root, "SELECT nope FROM steps"])
    assert 'sql: Binder Error: Referenced column "nope" not found' in line
    line = _error_line(runner, ["sql", root, "SELECT 1", "--format", "xml"])
    assert "--format 'xml'" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no graft tables found" in _error_line(runner, ["sql", str(empty), "SELECT 1"])


@pytest.mark.parametrize(
    "statement",
    [
        "COPY steps TO '{out}'",
        "COPY (SELECT * FROM steps) TO '{out}' (FORMAT parquet)",
        "EXPORT DATABASE '{dir}'",
        "ATTACH '{out}' AS other",
        "INSTALL httpfs",
        "LOAD httpfs",
        "CREATE TABLE t AS SELECT 1",
        "SET enable_external_access = true",
        "PRAGMA version",
        "SELECT 1; COPY steps TO '{out}'",
    ],
)
def test_only_read_queries_run(two_iter_run, tmp_path, statement):
    run, _ = two_iter_run
    out = tmp_path / "leak.csv"
    query = statement.format(out=out, dir=tmp_path / "export")
    with pytest.raises(GraftError, match=r"only SELECT / WITH queries are allowed|exactly one statement"):
        run_query(run.root, query)
    assert not out.exists() and not (tmp_path / "export").exists()


def test_files_outside_the_run_cannot_be_read(two_iter_run, tmp_path):
    run, _ = two_iter_run
    secret = tmp_path / "secret.csv"
    secret.write_text("a\n1\n")
    with pytest.raises(GraftError, match="Permission Error"):
        run_query(run.root, f"SELECT * FROM read_csv('{secret}')")
    with pytest.raises(GraftError, match="Permission Error"):
        run_query(run.root, "SELECT * FROM read_text('/etc/hostname')")


def test_a_synth_directory_can_be_queried(runner, tmp_path):
    out: Path = tmp_path / "synth"
    result = runner.invoke(app, ["synth", str(out), "--groups", "3", "--truth"])
    assert result.exit_code == 0, result.output
    joined = run_query(
        out,
        "SELECT count(*) AS n, count(t.v_true) AS with_truth FROM steps s JOIN truth t USING (traj_id, step)",
    )
    n = run_query(out, "SELECT count(*) FROM steps").item()
    assert joined.rows() == [(n, n)]


# --- sandbox hardening ---------------------------------------------------------------


def test_a_tmp_symlink_in_the_run_opens_no_way_out(runner, two_iter_run, monkeypatch):
    """DuckDB allows its temp directory (default <cwd>/.tmp); a run shipping `.tmp -> /` is refused."""
    run, _ = two_iter_run
    (run.root / ".tmp").symlink_to("/")
    monkeypatch.chdir(run.root)
    result = runner.invoke(app, ["sql", ".", "SELECT content FROM read_text('/etc/passwd')"])
    assert result.exit_code == 2, result.output
    assert "root:" not in result.stdout
    assert result.stderr.startswith("error: ") and "outside the run" in result.stderr


def test_a_tmp_symlink_in_the_working_directory_opens_no_way_out(runner, two_iter_run, tmp_path, monkeypatch):
    """The temp directory is set before the lock, so <cwd>/.tmp is never an allowed directory."""
    run, _ = two_iter_run
    work = tmp_path / "work"
    work.mkdir()
    (work / ".tmp").symlink_to("/")
    monkeypatch.chdir(work)
    for path in ("/etc/passwd", ".tmp/etc/passwd"):
        result = runner.invoke(app, ["sql", str(run.root), f"SELECT content FROM read_text('{path}')"])
        assert result.exit_code == 2, result.output
        assert "root:" not in result.stdout and "Permission Error" in result.stderr


def test_symlinks_out_of_the_run_are_refused(two_iter_run, tmp_path):
    run, _ = two_iter_run
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (run.iter_dir(0) / "data").symlink_to(outside)
    with pytest.raises(GraftError, match=r"data: symlink to .*elsewhere, outside the run"):
        run_query(run.root, "SELECT 1")
    (run.iter_dir(0) / "data").unlink()
    (run.iter_dir(0) / "alias.parquet").symlink_to(run.table_path(0, "steps"))  # inside: fine
    assert run_query(run.root, "SELECT 1 AS one").item() == 1


SPILLING_QUERY = "SELECT count(DISTINCT s) FROM (SELECT range::VARCHAR || 'x' AS s FROM range(2000000))"


def test_a_query_that_spills_works_and_writes_nothing_into_the_run(two_iter_run, monkeypatch):
    run, _ = two_iter_run
    monkeypatch.chdir(run.root)
    before = sorted(p.relative_to(run.root) for p in run.root.rglob("*"))
    # the same memory limit without a temp directory runs out of memory: the query must spill
    with pytest.raises(GraftError, match="(?i)out of memory"):
        check_read_only(SPILLING_QUERY)
        with private_temp_dir():
            con, _ = connect(run.root, temp_dir=None, memory_limit="24MB")
            try:
                con.sql(SPILLING_QUERY).fetchall()
            except duckdb.Error as exc:
                raise GraftError(str(exc)) from None
            finally:
                con.close()
    assert run_query(run.root, SPILLING_QUERY, memory_limit="24MB").item() == 2_000_000
    assert sorted(p.relative_to(run.root) for p in run.root.rglob("*")) == before


def test_sql_timeout_stops_a_runaway_query(runner, two_iter_run):
    run, _ = two_iter_run
    query = "SELECT count(*) FROM range(1000000000000)"
    result = runner.invoke(app, ["sql", str(run.root), query, "--timeout", "0.5"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: sql: query stopped after --timeout 0.5 s"
    assert _error_line(runner, ["sql", str(run.root), "SELECT 1", "--timeout", "0"]).endswith("got 0.0")


def test_ctrl_c_ends_sql_with_exit_130_and_no_traceback(two_iter_run, tmp_path):
    run, _ = two_iter_run
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(REPO)}
    query = "SELECT count(*) FROM range(1000000000000)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "graft_cli", "sql", str(run.root), query],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background jobs ignore SIGINT and children inherit that: restore the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        while not any(temp.glob("graft-sql-*")) and proc.poll() is None:  # the query is starting
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "error: interrupted"
    assert not any(temp.glob("graft-sql-*"))  # the private temp directory is removed


def test_table_output_prints_cells_literally(runner, two_iter_run):
    run, _ = two_iter_run
    query = "SELECT '[bold]x[/bold] :x: ' || chr(27) || '[31mred' || chr(10) || 'next' AS \"[i]c\""
    result = runner.invoke(app, ["sql", str(run.root), query])
    assert result.exit_code == 0, result.output
    assert "[bold]x[/bold] :x:" in result.stdout and "[i]c" in result.stdout
    assert "\\x1b[31mred\\nnext" in result.stdout
    assert "\x1b" not in result.stdout and "\u274c" not in result.stdout


def test_tables_written_with_o_take_the_iteration_of_their_metrics(runner, tmp_path):
    steps = synth_steps(groups=2, group_size=3, seed=1).with_columns(pl.lit(3, dtype=pl.Int32).alias("iter"))
    write_table(steps, "steps", tmp_path / "steps.parquet")
    out = tmp_path / "out"
    result = runner.invoke(app, ["advantage", str(tmp_path / "steps.parquet"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    metric_iters = set(run_query(out, "SELECT DISTINCT iter FROM metrics")["iter"].to_list())
    assert len(metric_iters) == 1  # the file-mode stages stamp one iteration
    for view in ("nodes", "edges", '"values"', "advantages"):
        iters = run_query(out, f"SELECT DISTINCT iter FROM {view}")["iter"].to_list()
        assert iters == list(metric_iters), view  # was null while metrics said 0


def test_top_level_tables_without_one_iteration_keep_a_null_iter(tmp_path):
    for it in (0, 1):  # two iterations' metrics at the top: no single iteration to give the nodes
        write_table(_metrics(it, f"s{it}", ["a"]), "metrics", tmp_path / f"metrics_s{it}.parquet")
    nodes = pl.DataFrame(
        {"group_id": ["g"], "node": [0], "state": ["s"], "visits": [1], "out_edges": [0], "ends": [0],
         "end_value": [None]}
    )  # fmt: skip
    write_table(nodes, "nodes", tmp_path / "nodes.parquet")
    assert run_query(tmp_path, "SELECT iter FROM nodes")["iter"].to_list() == [None]
