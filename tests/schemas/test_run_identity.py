"""A finished iteration copied whole from another run -- its tables, manifest and checkpoint consistent
with each other, its number and ``iterations_from`` right -- was taken as the run's own: ``graft solve
--force`` recomputed it into a run of two histories, exit 0. The run's manifest records a random
``run_id`` that each iteration's manifest repeats, so the copy is refused by every reader and writer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.manifest import MANIFEST_FILE
from tests.helpers.damage import one_error_line
from tests.helpers.lock_holder import tree

COMMANDS = {
    "sql": ["sql", "{run}", "SELECT count(*) FROM steps"],
    "solve --force": ["solve", "{run}", "--iter", "1", "--force", "--yes"],
    "loop": ["loop", "--run", "{run}", "--iters", "3"],
    "eval": ["eval", "{run}", "--iter", "1", "--force"],
}


def _another_run(run: Path, tmp_path: Path) -> Path:
    """A copy of ``run`` that is another run: its own identity in every manifest."""
    other = tmp_path / "other"
    shutil.copytree(run, other)
    for path in [other / MANIFEST_FILE, *other.glob(f"iter_*/{MANIFEST_FILE}")]:
        data = json.loads(path.read_text())
        data["run_id"] = "0" * 32
        path.write_text(json.dumps(data))
    return other


def test_every_iteration_repeats_the_runs_identity(run: Path) -> None:
    identity = json.loads((run / MANIFEST_FILE).read_text())["run_id"]
    assert len(identity) == 32
    for folder in sorted(run.glob("iter_*")):
        assert json.loads((folder / MANIFEST_FILE).read_text())["run_id"] == identity


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_iteration_of_another_run_is_refused(run: Path, tmp_path: Path, command: str) -> None:
    other = _another_run(run, tmp_path)
    shutil.rmtree(run / "iter_0001")
    shutil.copytree(other / "iter_0001", run / "iter_0001")
    before = tree(run)
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)) for a in COMMANDS[command]])
    line = one_error_line(result, f"{run}/iter_0001/manifest.json: records another run")
    assert "graft rollout" in line
    assert tree(run) == before


@pytest.mark.parametrize("how", ["delete", "link"])
@pytest.mark.parametrize("command", ["sql", "loop"])
def test_a_finished_iteration_gone_is_refused(run: Path, command: str, how: str) -> None:
    """A finished iteration deleted whole (or replaced by a link to a folder that is no iteration) was
    read as an iteration never run: ``graft sql`` answered for iteration 0 alone, exit 0. The run's
    manifest records the iterations the loop finished."""
    shutil.rmtree(run / "iter_0001")
    if how == "link":
        (run / "iter_0001").symlink_to("checkpoints")
    before = tree(run)
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)) for a in COMMANDS[command]])
    one_error_line(result, "the run's manifest records iteration 1 as finished")
    assert tree(run) == before


def test_force_with_its_inputs_gone_removes_nothing(run: Path) -> None:
    """``graft graph --iter 1 --force`` with iteration 1 deleted removed checkpoints/iter_0001, then
    failed on the missing steps table (two lines, the checkpoint lost)."""
    shutil.rmtree(run / "iter_0001")
    before = tree(run)
    result = CliRunner().invoke(app, ["graph", str(run), "--iter", "1", "--force", "--yes"])
    one_error_line(result, "iter_0001")
    assert tree(run) == before
