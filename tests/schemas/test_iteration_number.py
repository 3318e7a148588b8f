"""A finished iteration knows its own number: its manifest records it (and the checkpoint marker already
did), so iteration 0 with its checkpoint copied whole over iteration 1 is refused by sql, the loop,
eval and export (an unfinished clone was refused already, a finished one was served). Each iteration's
manifest repeats the run manifest's ``iterations_from``, so deleting the run's manifest with an
iteration's manifest no longer turns a swapped iteration into "a run from before manifests"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.manifest import MANIFEST_FILE, forget_finished
from schemas.rundir import Run

READERS = {
    "sql": ["sql", "{run}", "SELECT count(*) FROM steps"],
    "loop": ["loop", "--run", "{run}", "--iters", "3"],
    "eval": ["eval", "{run}", "--iter", "1", "--force"],
    "export": ["export", "{run}", "--iter", "1", "-o", "{out}"],
    "report": ["report", "{run}", "-o", "{out}"],
}


def _refused(run: Path, out: Path, args: list[str], names: str) -> str:
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)).replace("{out}", str(out)) for a in args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert names in lines[0], lines[0]
    assert not out.exists()
    return lines[0]


def test_the_manifest_records_the_iteration_and_the_runs_rule(run: Path) -> None:
    for i in (0, 1):
        manifest = json.loads((run / f"iter_{i:04d}" / MANIFEST_FILE).read_text())
        assert manifest["iteration"] == i and manifest["iterations_from"] == 0


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_finished_iteration_copied_over_another_is_refused(run: Path, tmp_path: Path, reader: str) -> None:
    for folder in (run / "iter_0001", run / "checkpoints" / "iter_0001"):
        shutil.rmtree(folder)
    shutil.copytree(run / "iter_0000", run / "iter_0001")
    shutil.copytree(run / "checkpoints" / "iter_0000", run / "checkpoints" / "iter_0001")
    line = _refused(
        run, tmp_path / "out", READERS[reader], f"{run}/iter_0001/manifest.json: records iteration 0, not 1"
    )
    assert "graft rollout" in line


def test_a_checkpoint_of_another_iteration_is_refused_where_no_manifest_covers_it(
    run: Path, tmp_path: Path
) -> None:
    forget_finished(Run(run), 1)  # iteration 1 unfinished: no manifest to compare
    for name in ("metrics_loop.parquet", MANIFEST_FILE):
        (run / "iter_0001" / name).unlink()
    shutil.rmtree(run / "checkpoints" / "iter_0001")
    shutil.copytree(run / "checkpoints" / "iter_0000", run / "checkpoints" / "iter_0001")
    _refused(
        run,
        tmp_path / "out",
        READERS["eval"],
        f"{run}/checkpoints/iter_0001/graft_checkpoint.json: records iteration 0, not 1",
    )


@pytest.mark.parametrize("reader", ["sql", "loop", "report"])
def test_a_lost_run_manifest_does_not_excuse_a_manifest_less_iteration(
    run: Path, tmp_path: Path, reader: str
) -> None:
    (run / MANIFEST_FILE).unlink()
    (run / "iter_0000" / MANIFEST_FILE).unlink()
    # iteration 1's manifest as written before it listed the run's root record (which is refused first
    # when lost): the rule it repeats still holds
    path = run / "iter_0001" / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    del manifest["root"]
    path.write_text(json.dumps(manifest))
    shutil.copy(run / "iter_0001" / "steps.parquet", run / "iter_0000" / "steps.parquet")
    _refused(
        run,
        tmp_path / "out",
        READERS[reader],
        f"{run}/iter_0000/manifest.json: missing: a finished iteration without its manifest",
    )
    assert not (run / MANIFEST_FILE).exists() or reader != "loop"


def test_manifests_from_before_the_numbers_are_still_served(run: Path, tmp_path: Path) -> None:
    for i in (0, 1):
        path = run / f"iter_{i:04d}" / MANIFEST_FILE
        manifest = json.loads(path.read_text())
        del manifest["iteration"], manifest["iterations_from"]
        path.write_text(json.dumps(manifest))
    result = CliRunner().invoke(app, ["sql", str(run), "SELECT count(*) AS n FROM steps"])
    assert result.exit_code == 0, result.output
