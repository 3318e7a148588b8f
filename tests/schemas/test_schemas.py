"""schemas/: every table round-trips, readers refuse what differs, steps validation names the rule,
and an interrupted write never leaves something that looks finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import TABLES, conform, read_table, validate_steps, write_table
from schemas.definitions import STEPS_OPTIONAL
from schemas.errors import GraftError
from schemas.validate import RULES
from tests.helpers.paths import REPO


def _example_column(col, n: int, rng: np.random.Generator) -> pa.Array:
    """n values of the column's type, with a null in nullable columns."""
    t = col.type
    if pa.types.is_int32(t):
        values = [int(v) for v in rng.integers(-5, 100, n)]
    elif pa.types.is_float64(t):
        values = [float(v) for v in rng.normal(size=n)]
    elif pa.types.is_boolean(t):
        values = [bool(v) for v in rng.integers(0, 2, n)]
    elif pa.types.is_string(t):
        values = [f"{col.name}-{i}-é" for i in range(n)]
    elif pa.types.is_list(t):
        inner = t.value_type
        if pa.types.is_string(inner):
            values = [[f"c{i}", "d"] for i in range(n)]
        elif pa.types.is_floating(inner):
            values = [[float(x) for x in rng.normal(size=i % 3)] for i in range(n)]
        else:
            values = [list(range(i % 4)) for i in range(n)]
    else:  # pragma: no cover - a new type needs a generator here
        raise AssertionError(f"no example generator for {t}")
    if col.nullable:
        values[0] = None
    return pa.array(values, type=t)


def example_table(name: str, n: int = 5, seed: int = 0) -> pa.Table:
    spec = TABLES[name]
    rng = np.random.default_rng(seed)
    return pa.Table.from_arrays([_example_column(c, n, rng) for c in spec.columns], schema=spec.schema)


@pytest.mark.parametrize("name", list(TABLES))
def test_every_table_round_trips_and_is_stamped(tmp_path, name):
    table = example_table(name)
    path = write_table(table, name, tmp_path / f"{name}.parquet")
    meta = pq.read_schema(path).metadata
    assert meta[b"graft.table"] == name.encode()
    assert meta[b"graft.schema_version"] == str(TABLES[name].version).encode()
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    back = read_table(path, name)
    assert back.columns == TABLES[name].column_names
    assert back.to_arrow().cast(TABLES[name].schema).equals(table.cast(TABLES[name].schema))
    # polars input works the same way
    write_table(pl.from_arrow(table), name, tmp_path / "again.parquet")
    assert read_table(tmp_path / "again.parquet", name).equals(back)


def test_reader_refuses_another_table(tmp_path):
    path = write_table(example_table("nodes"), "nodes", tmp_path / "x.parquet")
    with pytest.raises(GraftError, match=r"x\.parquet: holds the 'nodes' table, expected 'edges'"):
        read_table(path, "edges")


def test_reader_refuses_another_schema_version(tmp_path):
    table = example_table("edges")
    path = tmp_path / "edges.parquet"
    meta = {b"graft.table": b"edges", b"graft.schema_version": b"99"}
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(
        GraftError, match=r"edges\.parquet: edges schema version 99, this graft reads version 1"
    ):
        read_table(path, "edges")


def test_reader_refuses_a_missing_column(tmp_path):
    table = example_table("values").drop_columns(["reaches_end"])
    path = tmp_path / "values.parquet"
    pq.write_table(table.replace_schema_metadata(TABLES["values"].schema.metadata), path)
    with pytest.raises(GraftError, match=r"values\.parquet: values table is missing column\(s\) reaches_end"):
        read_table(path, "values")


def test_reader_refuses_a_wrong_type(tmp_path):
    table = example_table("edges")
    table = table.set_column(3, "src", pa.array([f"n{i}" for i in range(table.num_rows)]))
    path = tmp_path / "edges.parquet"
    pq.write_table(table.replace_schema_metadata(TABLES["edges"].schema.metadata), path)
    with pytest.raises(GraftError, match=r"edges\.parquet: column 'src' has type string, expected int32"):
        read_table(path, "edges")


def test_reader_refuses_unstamped_files_unless_asked_and_non_parquet(tmp_path):
    path = tmp_path / "ext.parquet"
    pq.write_table(example_table("edges").replace_schema_metadata(None), path)
    with pytest.raises(GraftError, match=r"ext\.parquet: no graft\.table metadata"):
        read_table(path, "edges")
    assert read_table(path, "edges", require_stamp=False).height == 5
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(GraftError, match=r"junk\.parquet: not a readable Parquet file"):
        read_table(junk, "edges")
    with pytest.raises(GraftError, match=r"nope\.parquet: file not found"):
        read_table(tmp_path / "nope.parquet", "edges")
    with pytest.raises(GraftError, match=r"unknown table 'bogus'; tables: steps, nodes"):
        read_table(path, "bogus")


def test_conform_casts_safely_fills_optional_steps_columns_and_refuses_nulls(small_steps):
    external = small_steps.drop(list(STEPS_OPTIONAL)).with_columns(pl.col("step").cast(pl.Int64))
    arrow = conform(external, "steps", source="ext.parquet")
    assert arrow.schema.equals(TABLES["steps"].schema)
    assert all(arrow.column(c).null_count == arrow.num_rows for c in STEPS_OPTIONAL)
    too_big = small_steps.with_columns(pl.col("step").cast(pl.Int64) + 2**40)
    with pytest.raises(GraftError, match=r"ext\.parquet: column 'step' has type int64, expected int32"):
        conform(too_big, "steps", source="ext.parquet")
    with_null = small_steps.with_columns(pl.lit(None, pl.String).alias("action"))
    with pytest.raises(GraftError, match=r"ext\.parquet: column 'action' has \d+ null value"):
        conform(with_null, "steps", source="ext.parquet")
    extra = small_steps.with_columns(pl.lit(1).alias("my_column"))
    assert "my_column" not in conform(extra, "steps").column_names


# ---------------------------------------------------------------------------------------------
# steps validation: a valid synth table broken one rule at a time


def _multi_step_traj(steps: pl.DataFrame, min_len: int = 3) -> str:
    lengths = steps.group_by("traj_id").len().filter(pl.col("len") >= min_len).sort("traj_id")
    return lengths["traj_id"][0]


def _set(steps: pl.DataFrame, traj: str, step: int | None, **values) -> pl.DataFrame:
    where = pl.col("traj_id") == traj
    if step is not None:
        where = where & (pl.col("step") == step)
    return steps.with_columns(
        pl.when(where).then(pl.lit(v, dtype=steps.schema[k])).otherwise(pl.col(k)).alias(k)
        for k, v in values.items()
    )


def _break(rule: str, steps: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """Break exactly ``rule`` on trajectory ``traj``; return the table and ``traj``."""
    traj = _multi_step_traj(steps)
    last = steps.filter(pl.col("traj_id") == traj)["step"].max()
    if rule == "finite":
        return _set(steps, traj, 1, reward=float("nan")), traj
    if rule == "unique":
        row = steps.filter((pl.col("traj_id") == traj) & (pl.col("step") == 1))
        return pl.concat([steps, row]), traj
    if rule == "contiguous":
        return steps.filter(~((pl.col("traj_id") == traj) & (pl.col("step") == 1))), traj
    if rule == "one_done":
        return _set(steps, traj, 1, done=True, terminated=True), traj
    if rule == "done_ends":
        return _set(steps, traj, last, terminated=False, truncated=False), traj
    if rule == "chain":
        return _set(steps, traj, 0, next_state="elsewhere"), traj
    if rule == "outcome":
        other = float(steps.filter(pl.col("traj_id") == traj)["outcome"][0]) + 3.0
        return _set(steps, traj, 2, outcome=other), traj
    if rule == "group_traj":
        own = steps.filter(pl.col("traj_id") == traj)["group_id"][0]
        other_group = steps.filter(pl.col("group_id") != own)["group_id"][0]
        return _set(steps, traj, 2, group_id=other_group), traj
    if rule == "group_task":
        return _set(steps, traj, None, task_id="another-task"), traj
    raise AssertionError(rule)


@pytest.mark.parametrize("rule", list(RULES))
def test_each_steps_rule_is_enforced_with_its_message(small_steps, rule):
    validate_steps(small_steps, source="ok.parquet")
    broken, traj = _break(rule, small_steps)
    with pytest.raises(GraftError) as info:
        validate_steps(broken, source="runs/x/steps.parquet")
    message = str(info.value)
    assert message.startswith("runs/x/steps.parquet: ")
    assert f"trajectory '{traj}'" in message
    assert RULES[rule] in message
    assert "\n" not in message


def test_validation_names_the_other_group_and_task(small_steps):
    broken, traj = _break("group_traj", small_steps)
    other = broken.filter((pl.col("traj_id") == traj) & (pl.col("step") == 2))["group_id"][0]
    with pytest.raises(GraftError, match=f"also in group '{other}'"):
        validate_steps(broken)
    broken, traj = _break("group_task", small_steps)
    with pytest.raises(GraftError, match="task_id 'another-task'"):
        validate_steps(broken)


def test_last_row_not_done_is_refused(small_steps):
    traj = _multi_step_traj(small_steps)
    last = small_steps.filter(pl.col("traj_id") == traj)["step"].max()
    with pytest.raises(
        GraftError, match=f"trajectory '{traj}'.*{RULES['one_done']}: step {last} has done=False"
    ):
        validate_steps(_set(small_steps, traj, last, done=False))


def test_validation_accepts_any_row_order_and_rejects_empty(small_steps):
    validate_steps(small_steps.sample(fraction=1.0, shuffle=True, seed=1))
    with pytest.raises(GraftError, match="no rows"):
        validate_steps(small_steps.head(0))


def test_inf_outcome_is_refused(small_steps):
    traj = _multi_step_traj(small_steps)
    with pytest.raises(GraftError, match=RULES["finite"]):
        validate_steps(_set(small_steps, traj, None, outcome=float("inf")))


# ---------------------------------------------------------------------------------------------
# atomic writes


def test_a_writer_failing_mid_write_leaves_no_table(tmp_path, monkeypatch, small_steps):
    target = tmp_path / "steps.parquet"

    def half_write(table, where, **kwargs):  # ``where``: the open temporary file
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(OSError, match="disk full"):
        write_table(small_steps, "steps", target)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary file was removed too


def test_a_failed_rewrite_keeps_the_previous_complete_table(tmp_path, monkeypatch, small_steps):
    target = write_table(small_steps, "steps", tmp_path / "steps.parquet")
    monkeypatch.setattr(pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_table(small_steps.head(3), "steps", target)
    assert read_table(target, "steps").height == small_steps.height


def test_sigkill_while_writing_leaves_only_a_tmp_file(tmp_path):
    target = tmp_path / "steps.parquet"
    script = textwrap.dedent(
        f"""
        import numpy as np, polars as pl
        from stages.credit.synth import synth_steps
        from schemas import write_table
        steps = synth_steps(groups=3000, group_size=8, seed=0)
        # long random observations make the write take a while
        rng = np.random.default_rng(0)
        noise = pl.DataFrame({{f"n{{k}}": rng.integers(0, 2**62, steps.height) for k in range(20)}})
        steps = steps.with_columns(observation=noise.select(pl.concat_str(pl.all().cast(pl.String))).to_series())
        print("writing", flush=True)
        write_table(steps, "steps", {str(target)!r})
        print("finished", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == b"writing"
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".steps.parquet.*.tmp")):
            assert time.monotonic() < deadline and proc.poll() is None, (
                "the writer finished before it was killed"
            )
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert (
        len(leftovers) == 1 and leftovers[0].startswith(".steps.parquet.") and leftovers[0].endswith(".tmp")
    )


def test_older_steps_tables_still_read_with_new_columns_null(tmp_path):
    # steps v2 added the nullable `score`, v3 `choice_scores`; tables written by a graft that knew v1
    # or v2 read unchanged, with the columns they lack null.
    from tests.helpers.credit_cases import fig2_steps

    path = write_table(fig2_steps(), "steps", tmp_path / "v3.parquet")
    for version, dropped in ((b"1", ["score", "choice_scores"]), (b"2", ["choice_scores"])):
        table = pq.read_table(path).drop(dropped)
        meta = {b"graft.table": b"steps", b"graft.schema_version": version}
        pq.write_table(table.replace_schema_metadata(meta), tmp_path / "old.parquet")
        old = read_table(tmp_path / "old.parquet", "steps")
        assert old.columns == TABLES["steps"].column_names
        for name in dropped:
            assert old[name].null_count() == old.height
    meta = {b"graft.table": b"steps", b"graft.schema_version": b"4"}
    pq.write_table(pq.read_table(path).replace_schema_metadata(meta), tmp_path / "v4.parquet")
    with pytest.raises(GraftError, match="schema version 4"):
        read_table(tmp_path / "v4.parquet", "steps")
