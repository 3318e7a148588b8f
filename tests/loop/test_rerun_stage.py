"""A stage the loop runs again replaces its own entries of the manifest an unfinished iteration kept:
with iteration 1's done-marker, update outputs, evaluation and checkpoint deleted, the loop recomputed
the update and then its own evaluation refused the table the update had just written (the wall-clock
rows of metrics_update.parquet differ from the old manifest). The other files the old manifest lists
stay checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.manifest import MANIFEST_FILE, forget_finished
from schemas.rundir import Run
from tests.helpers.loop_runs import micro_run

REMOVED = ["metrics_loop.parquet", "update.parquet", "metrics_update.parquet", "eval.parquet"]


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(micro_run(tmp_path_factory.mktemp("ref")), copy)
    forget_finished(Run(copy), 1)  # as --force leaves the run's record before it removes them
    for name in REMOVED:
        (copy / "iter_0001" / name).unlink()
    shutil.rmtree(copy / "checkpoints" / "iter_0001")
    return copy


def test_the_loop_recomputes_deleted_update_outputs_and_records_them(run: Path) -> None:
    result = CliRunner().invoke(app, ["loop", "--run", str(run), "--iters", "2"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((run / "iter_0001" / MANIFEST_FILE).read_text())
    assert {"update.parquet", "metrics_update.parquet", "eval.parquet", "metrics_loop.parquet"} <= set(
        manifest["files"]
    )
    assert CliRunner().invoke(app, ["sql", str(run), "SELECT count(*) FROM update"]).exit_code == 0


def test_files_the_rerun_does_not_write_stay_checked(run: Path) -> None:
    shutil.copy(run / "iter_0000" / "steps.parquet", run / "iter_0001" / "steps.parquet")
    result = CliRunner().invoke(app, ["loop", "--run", str(run), "--iters", "2"])
    assert result.exit_code == 2, result.output
    assert "iter_0001/steps.parquet" in result.output and "manifest" in result.output
