"""schemas/rundir.py: create / reopen / refuse a changed config / force; stage completeness."""

from __future__ import annotations

import json

import pytest

from schemas.atomic import atomic_dir, atomic_write_text, commit_dir
from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.integrity import CHECKPOINT_MARKER
from schemas.manifest import acting_checkpoint
from schemas.rundir import Run, create_run, open_run


def test_create_saves_the_resolved_config_and_reopens(tmp_path):
    config = load_config(None, ["solve.gamma=0.9"])
    run = create_run(tmp_path / "r", config)
    assert load_config(run.config_path) == config
    before = run.config_path.stat().st_mtime_ns
    again = create_run(tmp_path / "r", load_config(None, ["solve.gamma=0.9"]))
    assert again.root == run.root
    assert run.config_path.stat().st_mtime_ns == before  # not rewritten
    assert open_run(tmp_path / "r").load_config() == config


def test_reopening_with_another_config_is_refused_unless_forced(tmp_path):
    create_run(tmp_path / "r", Config())
    changed = load_config(None, ["solve.gamma=0.5", "rollout.groups=3"])
    with pytest.raises(GraftError) as info:
        create_run(tmp_path / "r", changed)
    message = str(info.value)
    assert "config.toml: run was started with a different config" in message
    defaults = Config()
    assert f"solve.gamma: {defaults.solve.gamma!r} -> 0.5" in message
    assert f"rollout.groups: {defaults.rollout.groups!r} -> 3" in message
    assert "--force" in message
    assert load_config(tmp_path / "r" / "config.toml") == Config()  # untouched
    create_run(tmp_path / "r", changed, force=True)
    assert load_config(tmp_path / "r" / "config.toml") == changed


def test_open_run_errors_name_the_directory(tmp_path):
    with pytest.raises(GraftError, match=r"nowhere: run directory not found"):
        open_run(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(GraftError, match=r"plain: not a graft run \(no config.toml\)"):
        open_run(tmp_path / "plain")


def test_stage_complete_follows_the_outputs(new_run: Run, small_steps):
    assert not new_run.stage_complete("rollout", 0)
    new_run.write(0, "steps", small_steps)
    assert new_run.stage_complete("rollout", 0)
    assert not new_run.stage_complete("rollout", 1)
    # graph needs both of its tables
    new_run.iter_dir(0).joinpath("nodes.parquet").write_bytes(b"")
    assert not new_run.stage_complete("graph", 0)
    new_run.iter_dir(0).joinpath("edges.parquet").write_bytes(b"")
    assert new_run.stage_complete("graph", 0)
    # a temporary file is not an output
    new_run.iter_dir(0).joinpath(".values.parquet.x.tmp").write_bytes(b"")
    assert not new_run.stage_complete("solve", 0)
    assert new_run.iterations() == [0]
    assert new_run.read(0, "steps").equals(small_steps)


def test_update_is_complete_only_with_a_marked_checkpoint(new_run: Run):
    new_run.iter_dir(2).mkdir(parents=True)
    new_run.iter_dir(2).joinpath("update.parquet").write_bytes(b"")
    final = new_run.checkpoint_dir(2)
    final.mkdir(parents=True)  # an interrupted copy: files but no marker
    (final / "model.safetensors").write_bytes(b"half")
    assert not new_run.stage_complete("update", 2)
    assert new_run.latest_checkpoint() is None
    tmp = atomic_dir(final)
    (tmp / "model.safetensors").write_bytes(b"whole")
    (tmp / CHECKPOINT_MARKER).write_text(json.dumps({"iter": 2}))
    commit_dir(tmp, final)
    assert new_run.stage_complete("update", 2)
    assert (final / "model.safetensors").read_bytes() == b"whole"
    assert new_run.latest_checkpoint() == final
    assert new_run.latest_checkpoint(before=2) is None
    assert not [p for p in final.parent.iterdir() if p.name.endswith(".tmp")]


def test_iteration_i_acts_with_checkpoint_i_minus_1_and_never_an_older_one(new_run: Run):
    assert acting_checkpoint(new_run, 0, "rollout") is None  # the initial model
    with pytest.raises(GraftError, match=r"rollout of iteration 1: .*iter_0000 is not a complete checkpoint"):
        acting_checkpoint(new_run, 1, "rollout")
    for it in (0, 1):
        tmp = atomic_dir(new_run.checkpoint_dir(it))
        (tmp / CHECKPOINT_MARKER).write_text("{}")
        commit_dir(tmp, new_run.checkpoint_dir(it))
    assert acting_checkpoint(new_run, 2, "update") == new_run.checkpoint_dir(1)
    # checkpoint 2 was never written: iteration 3 must not fall back to checkpoint 1
    with pytest.raises(GraftError, match=r"update of iteration 3: .*iter_0002"):
        acting_checkpoint(new_run, 3, "update")


def test_atomic_write_text_replaces_whole_files(tmp_path):
    path = tmp_path / "a" / "b.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["b.txt"]


def test_finished_outputs_get_umask_permissions_not_mkstemp_ones(tmp_path, small_steps):
    import os
    import stat

    from schemas import write_table
    from schemas.atomic import atomic_dir

    old = os.umask(0o022)
    try:
        text = tmp_path / "a.txt"
        atomic_write_text(text, "x")
        table = write_table(small_steps, "steps", tmp_path / "steps.parquet")
        folder = atomic_dir(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(text.stat().st_mode) == 0o644
    assert stat.S_IMODE(table.stat().st_mode) == 0o644
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


def test_committed_directories_are_readable_like_other_outputs(tmp_path):
    import os
    import stat
    import tempfile

    from schemas.atomic import atomic_dir, commit_dir

    umask = os.umask(0o022)
    try:
        tmp = atomic_dir(tmp_path / "ckpt")
        fd, name = tempfile.mkstemp(dir=tmp)  # how libraries write files: 0600
        os.close(fd)
        os.replace(name, tmp / "model.safetensors")
        commit_dir(tmp, tmp_path / "ckpt")
    finally:
        os.umask(umask)
    mode = stat.S_IMODE((tmp_path / "ckpt" / "model.safetensors").stat().st_mode)
    assert mode == 0o644
