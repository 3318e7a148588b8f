"""The run lock (docs/design.md §11): taken before a run's directory is touched, by the loop and every stage command."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.config import Config
from schemas.errors import GraftError
from schemas.lock import run_lock
from schemas.rundir import create_run
from stages.loop import run_loop
from tests.helpers.lock_holder import lock_held_elsewhere, tree
from tests.helpers.loop_runs import fake_runners

LOCKED = "another graft process is writing this run"


def _saved_run(root: Path) -> Path:
    config = Config()
    config.update.lr = 0.003
    config.run.eval_every = 0
    create_run(root, config)
    return root


def test_a_refused_second_loop_leaves_the_config_byte_identical(tmp_path: Path) -> None:
    root = _saved_run(tmp_path / "r")
    before = tree(root)
    with lock_held_elsewhere(root):
        result = CliRunner().invoke(
            app, ["loop", "--run", str(root), "--force", "--set", "update.lr=0.5", "--iters", "7"]
        )
    assert result.exit_code == 2, result.output
    assert LOCKED in result.stderr and "Traceback" not in result.output
    assert tree(root) == before  # config.toml included: lr 0.003, iters unchanged


def test_a_refused_start_with_a_bad_setting_writes_nothing(tmp_path: Path) -> None:
    new = tmp_path / "new"
    cfg = tmp_path / "c.toml"
    cfg.write_text(Config().to_toml())
    result = CliRunner().invoke(
        app, ["loop", "--config", str(cfg), "--run", str(new), "--set", "update.lr=inf"]
    )
    assert result.exit_code == 2 and "'update.lr' = inf is invalid" in result.stderr
    assert not new.exists()
    root = _saved_run(tmp_path / "r")
    before = tree(root)
    for bad in ("update.epochs=0", "rollout.temperature=nan", "run.device='gpu'"):
        result = CliRunner().invoke(app, ["loop", "--run", str(root), "--force", "--set", bad])
        assert result.exit_code == 2, (bad, result.output)
        assert tree(root) == before and not (root / ".lock").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["graph", "{run}", "--iter", "0"],
        ["solve", "{run}", "--iter", "0"],
        ["advantage", "{run}", "--iter", "0"],
        ["update", "{run}", "--iter", "0"],
        ["rollout", "{run}", "--iter", "0"],
        ["rollout", "{run}", "--iter", "0", "--shard", "0/2"],
        ["rollout", "{run}", "--iter", "0", "--merge", "2"],
        ["eval", "{run}", "--checkpoint", "initial"],
    ],
)
def test_every_stage_command_on_a_run_takes_the_lock(tmp_path: Path, args: list[str]) -> None:
    root = _saved_run(tmp_path / "r")
    before = tree(root)
    with lock_held_elsewhere(root):
        result = CliRunner().invoke(app, [a.format(run=root) for a in args])
    assert result.exit_code == 2, result.output
    assert LOCKED in result.stderr
    assert tree(root) == before


def test_shard_workers_share_the_lock_but_exclude_a_loop(tmp_path: Path) -> None:
    root = _saved_run(tmp_path / "r")
    with lock_held_elsewhere(root, shared=True):
        with run_lock(root, shared=True):
            pass  # another shard worker may run beside it
        with pytest.raises(GraftError, match=LOCKED), run_lock(root):
            pass


def test_a_loop_is_refused_while_another_process_holds_the_run(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    calls: list[tuple[str, int]] = []
    with lock_held_elsewhere(run.root), pytest.raises(GraftError, match=LOCKED):
        run_loop(run, config, 1, runners=fake_runners(calls), prepare=lambda *_: None)
    assert calls == []
    run_loop(run, config, 1, runners=fake_runners(calls), prepare=lambda *_: None)  # released
    assert len(calls) == 5


def test_the_lock_nests_within_one_process(tmp_path: Path) -> None:
    with run_lock(tmp_path / "r"), run_lock(tmp_path / "r"):
        pass
    with (
        run_lock(tmp_path / "r", shared=True),
        pytest.raises(GraftError, match="shared lock"),
        run_lock(tmp_path / "r"),
    ):
        pass


def test_a_start_refused_at_the_lock_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race: a second ``graft loop`` looks at a new folder, then a winner takes the lock and writes
    its config before the second reaches the lock. The refused start must remove none of the winner's
    files (it removed the whole folder, the winner's lock and config.toml included)."""
    import fcntl
    import subprocess
    import sys

    new = tmp_path / "new"
    cfg = tmp_path / "c.toml"
    cfg.write_text(Config().to_toml())
    winner_script = (
        "import fcntl, pathlib, sys\n"
        "root = pathlib.Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)\n"
        "fh = open(root / '.lock', 'a'); fcntl.flock(fh, fcntl.LOCK_EX)\n"
        "(root / 'config.toml').write_text(sys.argv[2])\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    winner: list[subprocess.Popen[str]] = []
    real_flock = fcntl.flock

    def flock_after_the_winner(fh, operation):  # type: ignore[no-untyped-def]
        if not winner and operation & fcntl.LOCK_NB:  # the second loop is about to take the lock
            proc = subprocess.Popen(
                [sys.executable, "-c", winner_script, str(new), cfg.read_text()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            winner.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return real_flock(fh, operation)  # the same lock file: refused, the winner holds it

    monkeypatch.setattr(fcntl, "flock", flock_after_the_winner)
    try:
        result = CliRunner().invoke(app, ["loop", "--config", str(cfg), "--run", str(new)])
        assert result.exit_code == 2 and LOCKED in result.stderr, result.output
        assert (new / "config.toml").read_text() == cfg.read_text()
        assert (new / ".lock").is_file()
    finally:
        for proc in winner:
            proc.kill()
            proc.wait()
