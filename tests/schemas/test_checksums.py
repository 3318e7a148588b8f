"""Finished outputs carry checksums that loading and resuming verify (docs/design.md §11)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas import read_table, write_table
from schemas.atomic import atomic_dir, commit_dir
from schemas.config import Config
from schemas.errors import GraftError
from schemas.integrity import CHECKPOINT_MARKER, checkpoint_damage, file_digests, verify_checkpoint
from schemas.io import verify_table
from schemas.manifest import forget_finished
from schemas.rundir import create_run
from stages.credit.synth import synth_steps
from stages.loop import run_loop
from tests.helpers.damage import data_region, flip_bit
from tests.helpers.loop_runs import fake_runners


def test_a_bit_flip_in_table_data_is_an_error_naming_the_file(tmp_path: Path) -> None:
    steps = synth_steps(groups=6, group_size=4, horizon=6, seed=1)
    clean = tmp_path / "clean.parquet"
    write_table(steps, "steps", clean)
    assert pq.read_schema(clean).metadata[b"graft.checksum"] == b"parquet-page-crc32"
    start, end = data_region(clean)
    rng = random.Random(0)
    for trial in range(25):  # every flip in the data is caught, or (a page header's spare bit) harmless
        path = tmp_path / f"flip{trial}.parquet"
        path.write_bytes(clean.read_bytes())
        flip_bit(path, rng.randrange(start, end), rng.randrange(8))
        try:
            got = read_table(path, "steps")
        except GraftError as exc:
            assert str(exc).startswith(f"{path}: damaged Parquet data"), exc
            assert verify_table(path) is not None
            continue
        assert got.equals(read_table(clean, "steps")), f"silently different data at trial {trial}"


def test_a_damaged_table_is_one_error_line_in_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "steps.parquet"
    write_table(synth_steps(groups=4, group_size=4, seed=2), "steps", path)
    start, end = data_region(path)
    flip_bit(path, (start + end) // 2, 3)
    result = CliRunner().invoke(app, ["advantage", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: {path}: damaged Parquet data")
    assert "Traceback" not in result.output


def test_corrupt_data_pages_under_an_intact_footer_without_checksums(tmp_path: Path) -> None:
    """A file from another tool (no page CRCs): junk in its pages is still one GraftError."""
    path = tmp_path / "external.parquet"
    synth_steps(groups=8, group_size=4, seed=3).write_parquet(path, compression="zstd")
    start, end = data_region(path)
    data = bytearray(path.read_bytes())
    data[start : start + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(GraftError, match=rf"{path}: damaged Parquet data"):
        read_table(path, "steps", require_stamp=False)


@pytest.mark.parametrize("stamp", [b"two", b"", b"1.5"])
def test_a_non_integer_schema_version_is_one_error(tmp_path: Path, stamp: bytes) -> None:
    path = tmp_path / "steps.parquet"
    write_table(synth_steps(groups=2, group_size=2, seed=0), "steps", path)
    table = pq.read_table(path)
    meta = {**table.schema.metadata, b"graft.schema_version": stamp}
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(
        GraftError, match=rf"steps schema version {stamp.decode()!r}, this graft reads version"
    ):
        read_table(path, "steps")


def _checkpoint(final: Path, payload: bytes = b"weights" * 1000) -> Path:
    tmp = atomic_dir(final)
    (tmp / "model.safetensors").write_bytes(payload)
    (tmp / "trainer_state").mkdir()
    (tmp / "trainer_state" / "state.json").write_text('{"global_step": 1}')
    (tmp / CHECKPOINT_MARKER).write_text(json.dumps({"files": file_digests(tmp)}))
    commit_dir(tmp, final)
    return final


def test_a_bit_flipped_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    final = _checkpoint(tmp_path / "ck")
    assert verify_checkpoint(final) == final and checkpoint_damage(final) is None
    flip_bit(final / "model.safetensors", 100)
    with pytest.raises(GraftError, match=rf"{final / 'model.safetensors'}: checksum mismatch"):
        verify_checkpoint(final)
    (final / "model.safetensors").unlink()
    assert checkpoint_damage(final) == f"{final / 'model.safetensors'}: missing from the checkpoint"


def test_save_checkpoint_records_every_file_in_the_marker(tmp_path: Path) -> None:
    from stages.update.checkpoint import save_checkpoint
    from tests.helpers.tiny_qwen import tiny_qwen2

    final = save_checkpoint(tmp_path / "ck", tiny_qwen2(), None, {"iteration": 0}, optimizer_state={})
    marker = json.loads((final / CHECKPOINT_MARKER).read_text())
    assert marker["iteration"] == 0
    assert marker["files"] == file_digests(final)
    assert {"model.safetensors", "config.json", "trainer_state/state.json"} <= set(marker["files"])


def test_graft_eval_refuses_a_damaged_or_truncated_checkpoint(tmp_path: Path) -> None:
    from stages.update.checkpoint import save_checkpoint
    from tests.helpers.tiny_qwen import tiny_qwen2

    run = create_run(tmp_path / "r", Config())
    final = save_checkpoint(run.checkpoint_dir(0), tiny_qwen2(), None, {"iteration": 0})
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    result = CliRunner().invoke(app, ["eval", str(run.root), "--iter", "0"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith(f"error: {weights}: checksum mismatch (the checkpoint file is damaged); ")
    assert f"graft update {run.root} --iter 0 --force" in line and "\n" not in line
    # without a checksum (a plain model directory), loading a truncated file is one error too
    (final / CHECKPOINT_MARKER).unlink()
    (final / "generation_config.json").unlink(missing_ok=True)
    from stages.update.checkpoint import load_model

    with pytest.raises(GraftError, match=rf"{final}: cannot load the model"):
        load_model(final)


def test_resume_redoes_a_stage_whose_outputs_are_damaged(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    calls: list[tuple[str, int]] = []
    runners = fake_runners(calls)

    def update(run_, it, config_):  # the fake update with a checksummed checkpoint
        calls.append(("update", it))
        run_.write(
            it,
            "update",
            pl.DataFrame({"iter": [it], "epoch": [-1], "minibatch": [-1], "name": ["loss"], "value": [0.5]}),
        )
        _checkpoint(run_.checkpoint_dir(it))

    runners["update"] = update
    run_loop(run, config, 1, runners=runners, prepare=lambda *_: None)
    values_before = read_table(run.table_path(0, "values"), "values")
    # killed before the iteration's manifest and end marker, and meanwhile two outputs were damaged
    forget_finished(run, 0)  # as the record stands before the done-marker is written
    (run.iter_dir(0) / "metrics_loop.parquet").unlink()
    (run.iter_dir(0) / "manifest.json").unlink()
    start, end = data_region(run.table_path(0, "values"))
    flip_bit(run.table_path(0, "values"), (start + end) // 2, 1)
    flip_bit(run.checkpoint_dir(0) / "model.safetensors", 10)
    calls.clear()
    (result,) = run_loop(run, config, 1, runners=runners, prepare=lambda *_: None)
    assert calls == [("solve", 0), ("update", 0)]
    assert set(result.redone) == {"solve", "update"}
    assert "values.parquet: damaged Parquet data" in result.redone["solve"][0]
    assert "model.safetensors: checksum mismatch" in result.redone["update"][0]
    assert read_table(run.table_path(0, "values"), "values").equals(values_before)
    assert verify_checkpoint(run.checkpoint_dir(0))
