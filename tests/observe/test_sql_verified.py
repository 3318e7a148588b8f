"""graft sql serves no damaged byte (docs/design.md §11): every table a view covers is verified
with pyarrow's page checksums before DuckDB (which does not check them) reads it, cached by file identity."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import schemas.verified as verified
from schemas import write_table
from schemas.errors import GraftError
from stages import credit
from stages.credit.synth import synth_steps
from stages.observe.sql import run_query
from tests.helpers.damage import data_region, flip_bit


def _run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    folder = root / "iter_0000"
    folder.mkdir(parents=True)
    steps = synth_steps(groups=6, group_size=4, horizon=6, seed=1)
    tables = credit.run_all(steps)
    write_table(steps, "steps", folder / "steps.parquet")
    write_table(tables.advantages, "advantages", folder / "advantages.parquet")
    return root


def test_a_flipped_bit_in_an_advantages_table_is_refused_not_served(tmp_path):
    root = _run(tmp_path)
    clean = root / "iter_0000" / "advantages.parquet"
    good = clean.read_bytes()
    expected = run_query(root, "SELECT sum(advantage) AS s FROM advantages")["s"][0]
    start, end = data_region(clean)
    rng = random.Random(0)
    served_wrong = 0
    for _ in range(30):  # without the check, 25 of 30 such flips came back as different numbers
        clean.write_bytes(good)
        flip_bit(clean, rng.randrange(start, end), rng.randrange(8))
        try:
            got = run_query(root, "SELECT sum(advantage) AS s FROM advantages")["s"][0]
        except GraftError as exc:
            assert str(exc).startswith(str(clean)) and "\n" not in str(exc)
            continue
        served_wrong += got != expected
    assert served_wrong == 0


def test_a_second_query_reads_nothing_again_until_a_file_changes(tmp_path, monkeypatch):
    root = _run(tmp_path)
    reads = []
    real = verified.verify_table
    monkeypatch.setattr(verified, "verify_table", lambda path: reads.append(Path(path).name) or real(path))
    run_query(root, "SELECT count(*) FROM steps")
    assert sorted(reads) == ["advantages.parquet", "steps.parquet"]
    run_query(root, "SELECT count(*) FROM advantages")
    assert len(reads) == 2  # cached by file identity
    table = root / "iter_0000" / "steps.parquet"
    os.utime(table, ns=(table.stat().st_atime_ns, table.stat().st_mtime_ns))  # ctime moves on
    table.write_bytes(table.read_bytes())
    run_query(root, "SELECT count(*) FROM steps")
    assert reads[2:] == ["steps.parquet"]


def test_the_cache_lives_where_graft_cache_dir_says(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path / "c"))
    run_query(_run(tmp_path), "SELECT 1")
    assert (tmp_path / "c" / verified.CACHE_FILE).is_file()
    with pytest.raises(GraftError):  # a damaged cache file is ignored, not trusted: still verifies
        (tmp_path / "c" / verified.CACHE_FILE).write_text("{not json")
        root = tmp_path / "run"
        (root / "iter_0000" / "steps.parquet").write_bytes(b"PAR1garbagePAR1")
        run_query(root, "SELECT count(*) FROM steps")


def test_the_warm_starts_tables_are_views_too(tmp_path):
    # graft sql did not see the warm start's tables
    import polars as pl

    from schemas import write_table
    from schemas.metrics import metrics_frame

    root = _run(tmp_path)
    demos = synth_steps(groups=2, group_size=2, horizon=3, seed=5)
    write_table(demos, "steps", root / "sft" / "demos" / "steps.parquet")
    for r in (1, 2):
        write_table(demos.head(r + 1), "steps", root / "sft" / "dagger" / f"round_{r}" / "steps.parquet")
    write_table(metrics_frame(-1, "sft", {"loss_last": 0.5}), "metrics", root / "sft" / "metrics_sft.parquet")
    assert run_query(root, "SELECT count(*) AS n FROM demos")["n"][0] == demos.height
    rounds = run_query(root, "SELECT round, count(*) AS n FROM dagger_steps GROUP BY round ORDER BY round")
    assert rounds.rows() == [(1, 2), (2, 3)]
    got = run_query(root, "SELECT value FROM sft_metrics WHERE name = 'loss_last'")
    assert got["value"].to_list() == [0.5]
    assert isinstance(got, pl.DataFrame)
