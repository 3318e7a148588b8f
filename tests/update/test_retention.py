"""Checkpoint retention: keep_last / keep_every keep what resume and evaluation need,
optimizer state only in the newest, and a run with retention ends with the same tables as one without."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.rundir import Run, create_run
from stages.loop import run_loop
from stages.update.checkpoint import TRAINER_STATE_DIR
from stages.update.retention import prune_checkpoints, retained_checkpoints
from tests.helpers.loop_runs import MICRO, checkpoint_tensors, fake_runners, run_tables
from tests.helpers.paths import CONFIGS


def test_retained_checkpoints_hand_computed() -> None:
    its = list(range(10))
    # 2 newest {8, 9}; after every 4th update: i + 1 in {4, 8} -> {3, 7}; evaluated {5}
    assert retained_checkpoints(its, {5}, keep_last=2, keep_every=4) == {3, 5, 7, 8, 9}
    assert retained_checkpoints(its, set(), keep_last=1, keep_every=0) == {9}
    assert retained_checkpoints(its, {2}, keep_last=0, keep_every=3) == set(its)  # 0 = keep everything
    assert retained_checkpoints([4, 7], set(), keep_last=5, keep_every=0) == {4, 7}
    assert retained_checkpoints([], set(), keep_last=1, keep_every=2) == set()


@pytest.mark.parametrize("key", ["checkpoint.keep_last", "checkpoint.keep_every"])
def test_negative_retention_is_refused(key: str) -> None:
    with pytest.raises(GraftError, match=rf"'{key}' = -1 is invalid; must be >= 0"):
        load_config(None, [f"{key}=-1"])


def _runners_with_optimizer_state() -> dict:
    runners = fake_runners([])
    update = runners["update"]

    def with_state(run: Run, it: int, config: Config) -> None:
        update(run, it, config)
        (run.checkpoint_dir(it) / TRAINER_STATE_DIR).mkdir()
        (run.checkpoint_dir(it) / TRAINER_STATE_DIR / "state.json").write_text("{}")

    return {**runners, "update": with_state}


def test_the_loop_prunes_after_every_iteration(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 4  # evaluated: iterations 3 and 7 (the last)
    config.checkpoint.keep_last, config.checkpoint.keep_every = 2, 3
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, 8, runners=_runners_with_optimizer_state(), prepare=lambda *_: None)
    # 2 newest {6, 7}; after every 3rd update {2, 5}; evaluated {3, 7}
    assert run.checkpoint_iterations() == [2, 3, 5, 6, 7]
    with_state = [
        i for i in run.checkpoint_iterations() if (run.checkpoint_dir(i) / TRAINER_STATE_DIR).is_dir()
    ]
    assert with_state == [7]  # optimizer state only where the next update reads it
    assert not list((run.root / "checkpoints").glob(".*"))  # nothing left half-deleted
    assert prune_checkpoints(run, config.checkpoint) == []  # idempotent


def test_no_retention_by_default(tmp_path: Path) -> None:
    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, 4, runners=_runners_with_optimizer_state(), prepare=lambda *_: None)
    assert run.checkpoint_iterations() == [0, 1, 2, 3]
    assert all((run.checkpoint_dir(i) / TRAINER_STATE_DIR).is_dir() for i in range(4))


def test_changing_retention_is_not_a_config_change(tmp_path: Path) -> None:
    from stages.loop.start import resolve_loop_run

    cfg = str(CONFIGS / "quickstart.toml")
    run, _, _ = resolve_loop_run(cfg, str(tmp_path / "r"), [], 0, False)
    run, config, _ = resolve_loop_run(
        cfg, str(tmp_path / "r"), ["checkpoint.keep_last=2", "log.tensorboard=true"], 0, False
    )
    saved = load_config(run.config_path)
    assert (
        (saved.checkpoint.keep_last, saved.log.tensorboard)
        == (2, True)
        == (
            config.checkpoint.keep_last,
            config.log.tensorboard,
        )
    )
    with pytest.raises(GraftError, match="update.lr"):  # anything else still is
        resolve_loop_run(cfg, str(tmp_path / "r"), ["update.lr=0.5"], 0, False)


# ---------------------------------------------------------------------------------------------
# the real stages: 3 micro iterations without evaluation, with and without keep_last = 1


def _micro(extra: list[str]) -> Config:
    return load_config(CONFIGS / "quickstart.toml", [*MICRO, "run.iters=3", "run.eval_every=0", *extra])


@pytest.mark.slow
def test_keep_last_1_stopped_crashed_and_resumed_gives_the_same_tables(tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    plain = _micro([])
    reference = create_run(tmp_path / "plain", plain)
    run_loop(reference, plain, 3)

    config = _micro(["checkpoint.keep_last=1"])
    run = create_run(tmp_path / "kept", config)
    run_loop(run, config, 2)  # stopped after 2 iterations: checkpoint 0 is gone
    assert run.checkpoint_iterations() == [1]
    from stages.loop import STAGE_RUNNERS

    def crash(*_: object) -> None:
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):  # crashed inside iteration 2, after its rollout
        run_loop(run, config, 3, runners={**STAGE_RUNNERS, "graph": crash})
    run_loop(run, config, 3)  # resumed
    assert run.checkpoint_iterations() == [2]
    assert (run.checkpoint_dir(2) / TRAINER_STATE_DIR).is_dir()
    want, got = run_tables(reference.root), run_tables(run.root)
    assert sorted(got) == sorted(want)
    for name, frame in want.items():
        assert got[name].equals(frame), name
    a, b = checkpoint_tensors(reference.root), checkpoint_tensors(run.root)
    assert set(b) <= set(a) and b
    for name in b:
        for key in b[name]:
            assert (a[name][key] == b[name][key]).all(), (name, key)


def test_the_gpu_configs_keep_few_checkpoints() -> None:
    # 150 iterations x (6 GB weights + 12 GB AdamW moments) of a 1.5B model would be terabytes
    for name in ("alfworld", "search", "shop", "textworld"):
        config = load_config(CONFIGS / f"{name}.toml")
        assert config.checkpoint.keep_last == 2 and config.run.eval_every == 10, name


def _runners_with_checksummed_state() -> dict:
    """Like the real update: optimizer state inside the checkpoint, listed in the marker's checksums."""
    import json

    from schemas.integrity import CHECKPOINT_MARKER, MARKER_FILES_KEY, file_digests

    runners = _runners_with_optimizer_state()
    update = runners["update"]

    def with_marker(run: Run, it: int, config: Config) -> None:
        update(run, it, config)
        folder = run.checkpoint_dir(it)
        marker = json.loads((folder / CHECKPOINT_MARKER).read_text())
        marker[MARKER_FILES_KEY] = file_digests(folder)
        (folder / CHECKPOINT_MARKER).write_text(json.dumps(marker))

    return {**runners, "update": with_marker}


def _pruned_run(tmp_path: Path, iters: int) -> Run:
    """``iters`` iterations with checksummed optimizer state, keep_last = 1 and keep_every = 2."""
    config = Config()
    config.run.eval_every = 0
    config.checkpoint.keep_last, config.checkpoint.keep_every = 1, 2
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, iters, runners=_runners_with_checksummed_state(), prepare=lambda *_: None)
    return run


def test_pruned_optimizer_state_leaves_every_kept_checkpoint_intact(tmp_path: Path) -> None:
    # pruning removed trainer_state/ while the kept checkpoints' markers still listed
    # it, so evaluating or resuming from them failed as "missing from the checkpoint"
    from schemas.integrity import checkpoint_damage, verify_checkpoint

    run = _pruned_run(tmp_path, 4)
    assert run.checkpoint_iterations() == [1, 3]
    assert not (run.checkpoint_dir(1) / TRAINER_STATE_DIR).exists()
    for i in run.checkpoint_iterations():
        assert checkpoint_damage(run.checkpoint_dir(i)) is None
        verify_checkpoint(run.checkpoint_dir(i))


def test_a_marker_whose_files_is_not_a_table_is_one_line(tmp_path: Path) -> None:
    import json

    from schemas.integrity import CHECKPOINT_MARKER, checkpoint_damage

    (tmp_path / CHECKPOINT_MARKER).write_text(json.dumps({"files": ["model.safetensors"]}))
    assert "'files' is not a table" in checkpoint_damage(tmp_path)


def test_force_checks_the_acting_checkpoint_before_it_removes_anything(tmp_path: Path) -> None:
    # `graft update R --iter 1 --force` with keep_last=1, keep_every=2 deleted
    # iteration 2 and its checkpoint, then failed (checkpoint 0, which iteration 1 trains, was pruned)
    from schemas.recompute import guard_recompute

    run = _pruned_run(tmp_path, 3)
    assert run.checkpoint_iterations() == [1, 2]
    for stage in ("update", "rollout"):
        with pytest.raises(
            GraftError, match=r"iter_0000 is not a complete checkpoint.*--force removed nothing"
        ):
            guard_recompute(run, stage, 1, force=True)
        assert run.checkpoint_iterations() == [1, 2] and run.stage_complete("update", 2)
    # with the acting checkpoint intact (iteration 2 acts from checkpoint 1) --force goes ahead
    removed = guard_recompute(run, "rollout", 2, force=True)
    assert run.checkpoint_dir(2) in removed and run.checkpoint_iterations() == [1]
