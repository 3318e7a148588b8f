"""No folder or file a writer creates, enters or removes inside a run is a symlink, checked where it is
opened (schemas.confine.open_run_folder: each folder from the run's root with O_NOFOLLOW, files made
and renamed relative to it), not only when the lock is taken:

- a link inside the run, ``iter_0001 -> iter_0000``: ``graft rollout --iter 1 --force --yes`` deleted
  finished iteration 0's tables through it and wrote iteration 1's rows there; every stage command and
  the loop now refuse it with one line and change nothing;
- a link made after the lock's check (while a loop runs) sent a whole iteration's files outside the
  run; the write itself now refuses it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import Run, create_run
from stages.loop import run_loop
from tests.helpers.damage import one_error_line
from tests.helpers.loop_runs import fake_runners


def _listing(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != ".lock" and ".lock" not in p.parts
    }


WRITERS = {
    "rollout": ["rollout", "{run}", "--iter", "1", "--force", "--yes", "--no-progress"],
    "graph": ["graph", "{run}", "--iter", "1", "--force", "--yes"],
    "advantage": ["advantage", "{run}", "--iter", "1", "--force", "--yes"],
    "update": ["update", "{run}", "--iter", "1", "--force", "--yes"],
    "eval": ["eval", "{run}", "--iter", "1", "--force"],
    "loop": ["loop", "--run", "{run}", "--iters", "3"],
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_iteration_linked_to_another_inside_the_run_is_refused(run: Path, writer: str) -> None:
    shutil.rmtree(run / "iter_0001")
    (run / "iter_0001").symlink_to("iter_0000")
    before = _listing(run)
    result = CliRunner().invoke(app, [a.replace("{run}", str(run)) for a in WRITERS[writer]])
    one_error_line(result, "iter_0001")
    assert _listing(run) == before  # iteration 0 (reached through the link too) is untouched
    assert (run / "iter_0001").is_symlink()


def test_a_checkpoint_linked_inside_the_run_is_refused(run: Path) -> None:
    shutil.rmtree(run / "checkpoints" / "iter_0001")
    (run / "checkpoints" / "iter_0001").symlink_to("iter_0000")
    before = _listing(run)
    result = CliRunner().invoke(app, ["update", str(run), "--iter", "1", "--force", "--yes"])
    one_error_line(result, "iter_0001")
    assert _listing(run) == before


def test_a_link_made_while_the_loop_runs_is_not_written_through(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    outside = tmp_path / "outside"
    outside.mkdir()
    runners = fake_runners([])
    rollout = runners["rollout"]

    def rollout_after_a_swap(r: Run, it: int, cfg: Config) -> None:
        if it == 1:  # after every check of the start: the iteration's folder becomes a link out
            r.iter_dir(1).mkdir(exist_ok=True)
            shutil.rmtree(r.iter_dir(1))
            r.iter_dir(1).symlink_to(outside, target_is_directory=True)
        rollout(r, it, cfg)

    runners["rollout"] = rollout_after_a_swap
    with pytest.raises(GraftError, match="iter_0001: a symlink .* inside the run"):
        run_loop(run, config, 2, runners=runners, prepare=lambda *_: None)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("where", ["checkpoints", "iter_0000"])
def test_the_write_helpers_refuse_a_link_on_the_way(tmp_path: Path, where: str) -> None:
    from schemas.atomic import atomic_dir, atomic_write_text, remove_outputs
    from schemas.lock import run_lock

    root = tmp_path / "run"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.txt").write_text("kept")
    with run_lock(root):
        (root / where).symlink_to(outside, target_is_directory=True)
        for write in (
            lambda: atomic_write_text(root / where / "a.json", "{}"),
            lambda: atomic_dir(root / where / "iter_0001"),
            lambda: remove_outputs([root / where / "kept.txt"]),
        ):
            with pytest.raises(GraftError, match=f"{where}: a symlink"):
                write()
    assert sorted(p.name for p in outside.iterdir()) == ["kept.txt"]
    atomic_write_text(root / where / "b.json", "{}")  # no lock held: a path outside any written run
    assert (outside / "b.json").is_file()
