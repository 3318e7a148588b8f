"""Small boundaries of a run: graft's cache directory cannot lie inside a run (it wrote its cache into a
finished iteration, which every later reader then refused), ``graft export`` removes the temporary
folders a killed export to the same output left beside it, and ``-o`` naming a symlink is refused with
a line that says so (it was "Not a directory")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.atomic import atomic_dir, remove_stale_temporaries
from tests.helpers.damage import one_error_line
from tests.helpers.lock_holder import tree


@pytest.mark.parametrize(
    "args",
    [
        ["sql", "{run}", "SELECT count(*) FROM steps"],
        ["loop", "--run", "{run}", "--iters", "2"],
        ["eval", "{run}", "--iter", "1", "--force"],
    ],
)
def test_a_cache_directory_inside_the_run_is_refused(
    run: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    cache = run / "iter_0001" / "cache"
    monkeypatch.setenv("GRAFT_CACHE_DIR", str(cache))
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)) for a in args])
    one_error_line(
        result, f"{cache}: graft's cache directory (GRAFT_CACHE_DIR, XDG_CACHE_HOME) is inside the run"
    )
    assert not cache.exists()
    monkeypatch.delenv("GRAFT_CACHE_DIR")
    assert CliRunner().invoke(app, ["sql", str(run), "SELECT 1"]).exit_code == 0  # the run is intact


@pytest.mark.parametrize(
    "args",
    [
        ["sql", "{run}", "SELECT count(*) FROM steps"],
        ["report", "{run}", "-o", "{out}"],
        ["eval", "{run}", "--iter", "1", "--force"],
    ],
)
def test_a_cache_directory_inside_another_run_is_refused(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """Reading run A with the cache in run B's finished iteration wrote into B, which every reader of B
    then refused: nothing outside a run's own writers writes into any run."""
    other = tmp_path / "other"
    shutil.copytree(run, other)
    before = tree(other)
    cache = other / "iter_0001"
    monkeypatch.setenv("GRAFT_CACHE_DIR", str(cache))
    out = tmp_path / "report"
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)).replace("{out}", str(out)) for a in args])
    one_error_line(
        result, f"{cache}: graft's cache directory (GRAFT_CACHE_DIR, XDG_CACHE_HOME) is inside the run"
    )
    assert tree(other) == before and sorted(p.name for p in cache.iterdir()) == sorted(
        p.name for p in (run / "iter_0001").iterdir()
    )


def test_export_removes_what_a_killed_export_left(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    left = atomic_dir(out)  # what a kill inside the export leaves: a half-filled temporary sibling
    (left / "model.safetensors").write_bytes(b"half")
    other = tmp_path / ".other.abcdefgh.tmp"  # another output's temporary: kept
    other.mkdir()
    result = CliRunner().invoke(app, ["export", str(run), "--iter", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and not left.exists() and other.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".exported")) == []


def test_only_the_temporaries_of_that_name_are_removed(tmp_path: Path) -> None:
    final = tmp_path / "out"
    mine, theirs = atomic_dir(final), atomic_dir(tmp_path / "out2")
    kept = tmp_path / ".out.not-a-temporary"
    kept.mkdir()
    assert remove_stale_temporaries(final) == [mine]
    assert theirs.is_dir() and kept.is_dir()


def test_export_to_a_symlink_names_the_link(run: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "link"
    link.symlink_to(empty)
    result = CliRunner().invoke(app, ["export", str(run), "--iter", "1", "-o", str(link)])
    line = one_error_line(result, f"{link}: is a symlink (to {empty})")
    assert "Not a directory" not in line
    assert link.is_symlink() and empty.is_dir() and not any(empty.iterdir())
