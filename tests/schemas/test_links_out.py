"""No command follows a link out of the run (schemas.confine): an iteration, a checkpoint, the initial
model or a table that is a symlink resolving outside the run is refused with one line by every writer
(the stage commands' --force, update, eval, the loop) and by export, before anything is removed or
written -- in the run or outside it. Links that stay inside the run are not refused up front (a writer
refuses one where it enters or removes it: tests/schemas/test_links_inside.py), and outside a run the
helpers that remove or replace a directory remove a link itself, never what it points to."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.atomic import atomic_dir, commit_dir, remove_outputs
from schemas.confine import links_out_of, refuse_links_out
from schemas.errors import GraftError


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != ".lock"
    }


def _linked_out(source: Path, tmp_path: Path, rel: str) -> tuple[Path, Path]:
    """A copy of the finished run whose ``rel`` is moved outside it and replaced by a symlink there."""
    run = tmp_path / "run"
    shutil.copytree(source, run)
    outside = tmp_path / "outside" / Path(rel).name
    outside.parent.mkdir()
    shutil.move(run / rel, outside)
    (run / rel).symlink_to(outside, target_is_directory=outside.is_dir())
    return run, outside


def _refused(run: Path, outside: Path, args: list[str], link: str) -> str:
    before_run, before_out = _listing(run), _listing(outside.parent)
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)) for a in args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert f"{run / link}: symlink to {outside}, outside the run" in lines[0], lines[0]
    assert _listing(outside.parent) == before_out  # nothing outside the run removed or written
    assert _listing(run) == before_run
    return lines[0]


WRITERS = {
    "graph": ["graph", "{run}", "--iter", "1", "--force", "--yes"],
    "update": ["update", "{run}", "--iter", "1", "--force", "--yes"],
    "rollout": ["rollout", "{run}", "--iter", "1", "--force", "--yes", "--no-progress"],
    "eval": ["eval", "{run}", "--iter", "1", "--force"],
    "loop": ["loop", "--run", "{run}", "--iters", "3"],
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_iteration_linked_out_of_the_run_is_refused_by_every_writer(
    source: Path, tmp_path: Path, writer: str
) -> None:
    run, outside = _linked_out(source, tmp_path, "iter_0001")
    line = _refused(run, outside, WRITERS[writer], "iter_0001")
    assert "graft writes nothing outside it" in line
    assert (outside / "values.parquet").is_file() and (outside / "manifest.json").is_file()


@pytest.mark.parametrize("writer", ["update", "graph", "eval"])
def test_a_checkpoint_linked_out_of_the_run_is_refused(source: Path, tmp_path: Path, writer: str) -> None:
    run, outside = _linked_out(source, tmp_path, "checkpoints/iter_0001")
    _refused(run, outside, WRITERS[writer], "checkpoints/iter_0001")
    assert (outside / "graft_checkpoint.json").is_file()


def test_export_and_sql_refuse_the_same_links(source: Path, tmp_path: Path) -> None:
    run, outside = _linked_out(source, tmp_path, "checkpoints/iter_0001")
    out = tmp_path / "exported"
    line = _refused(run, outside, ["export", "{run}", "--iter", "1", "-o", str(out)], "checkpoints/iter_0001")
    assert "graft export reads nothing outside it" in line and not out.exists()
    line = _refused(run, outside, ["sql", "{run}", "SELECT 1"], "checkpoints/iter_0001")
    assert "graft sql reads nothing outside it" in line


def test_the_initial_model_or_a_table_linked_out_is_refused(source: Path, tmp_path: Path) -> None:
    run, outside = _linked_out(source, tmp_path, "model")
    _refused(run, outside, ["eval", "{run}", "--checkpoint", "initial", "--force"], "model")
    table = tmp_path / "t"
    table.mkdir()
    run2, outside2 = _linked_out(source, table, "iter_0001/values.parquet")
    _refused(run2, outside2, WRITERS["graph"], "iter_0001/values.parquet")


def test_links_inside_the_run_are_allowed(tmp_path: Path) -> None:
    (tmp_path / "run" / "iter_0000").mkdir(parents=True)
    (tmp_path / "run" / "alias").symlink_to(tmp_path / "run" / "iter_0000")
    assert list(links_out_of(tmp_path / "run")) == []
    refuse_links_out(tmp_path / "run")
    refuse_links_out(tmp_path / "absent")  # a new run: nothing to check
    (tmp_path / "run" / "loop").symlink_to(tmp_path / "run" / "loop")
    with pytest.raises(GraftError, match="symlink loop"):
        refuse_links_out(tmp_path / "run")


def test_removing_or_replacing_a_link_never_touches_its_target(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept.txt").write_text("kept")
    link = tmp_path / "run" / "ckpt"
    link.parent.mkdir()
    link.symlink_to(target)
    remove_outputs([link])
    assert not link.is_symlink() and (target / "kept.txt").read_text() == "kept"
    link.symlink_to(target)
    tmp = atomic_dir(link)
    (tmp / "new.txt").write_text("new")
    commit_dir(tmp, link)  # was: shutil.rmtree refusing a symbolic link (a traceback)
    assert not link.is_symlink() and (link / "new.txt").is_file()
    assert (target / "kept.txt").read_text() == "kept"


@pytest.mark.parametrize(
    "args", [["report", "{run}"], ["viz", "{run}", "--iter", "1", "--group", "0"]], ids=["report", "viz"]
)
def test_report_and_viz_refuse_a_run_linked_out(source: Path, tmp_path: Path, args: list[str]) -> None:
    # without -o both write into the run (report/, viz/): a link out would take their files elsewhere
    run, outside = _linked_out(source, tmp_path, "iter_0001")
    line = _refused(run, outside, args, "iter_0001")
    assert "reads or writes nothing outside it" in line and not (run / "report").exists()
