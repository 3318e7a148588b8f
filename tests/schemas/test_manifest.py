"""A finished iteration is verified against its manifest before a resumed loop builds on it (docs/design.md §11):
a deleted values table or a swapped steps table is an error, not "nothing to do"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.config import Config
from schemas.errors import GraftError
from schemas.manifest import MANIFEST_FILE, forget_finished
from schemas.rundir import create_run
from stages.credit.synth import synth_steps
from stages.loop import run_loop
from tests.helpers.loop_runs import fake_runners


def _finished_run(tmp_path: Path, iters: int = 2):
    config = Config()
    config.run.eval_every = 1
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, iters, runners=fake_runners([]), prepare=lambda *_: None)
    return run, config


def test_a_finished_iteration_records_its_tables(tmp_path):
    run, _ = _finished_run(tmp_path)
    files = json.loads((run.iter_dir(0) / MANIFEST_FILE).read_text())["files"]
    assert {"steps.parquet", "nodes.parquet", "edges.parquet", "values.parquet", "advantages.parquet"} <= set(
        files
    )
    assert {"eval.parquet", "metrics_loop.parquet", "update.parquet"} <= set(files)  # the done-marker too
    assert files["steps.parquet"]["size"] == (run.iter_dir(0) / "steps.parquet").stat().st_size
    recorded = json.loads((run.iter_dir(0) / MANIFEST_FILE).read_text())["checkpoint"]
    assert recorded == {"files": {}, "marker": {}}  # the fake update's checkpoint: an empty marker


def test_an_intact_run_resumes_with_nothing_to_do(tmp_path):
    run, config = _finished_run(tmp_path)
    calls: list = []
    assert run_loop(run, config, 2, runners=fake_runners(calls), prepare=lambda *_: None) == []
    assert calls == []


def test_a_deleted_values_table_is_refused(tmp_path):
    run, config = _finished_run(tmp_path)
    (run.iter_dir(1) / "values.parquet").unlink()
    with pytest.raises(
        GraftError, match=r"iter_0001/values.parquet: listed in the finished iteration's manifest but missing"
    ):
        run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None)


def test_a_swapped_steps_table_is_refused(tmp_path):
    run, config = _finished_run(tmp_path)
    other = synth_steps(groups=2, group_size=3, horizon=4, seed=99, success_reward=10.0)
    run.write(0, "steps", other)  # a valid table with other rows, written the proper way
    with pytest.raises(GraftError, match=r"iter_0000/steps.parquet: (size|checksum) differs"):
        run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None)


def test_a_table_added_after_the_iteration_finished_is_refused(tmp_path):
    run, config = _finished_run(tmp_path)
    (run.iter_dir(0) / "truth.parquet").write_bytes((run.iter_dir(0) / "values.parquet").read_bytes())
    with pytest.raises(GraftError, match="not in the finished iteration's manifest"):
        run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None)


def test_a_replaced_evaluation_is_not_damage(tmp_path):
    run, config = _finished_run(tmp_path)
    evaluation = run.table_path(1, "eval")
    evaluation.write_bytes(evaluation.read_bytes())  # graft eval --force replaces it
    assert run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None) == []


def test_unchanged_files_are_hashed_once(tmp_path, monkeypatch):
    import hashlib

    run, config = _finished_run(tmp_path)
    hashed = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda fh, name: hashed.append(fh.name) or real(fh, name))
    run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None)
    first = len(hashed)
    assert first > 0
    run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None)
    assert len(hashed) == first


def test_a_table_swapped_in_without_done_marker_or_manifest_is_not_blessed(tmp_path):
    # the iteration looks interrupted (no done-marker, no manifest), and its steps table is another's:
    # the loop must not record it as finished
    run, config = _finished_run(tmp_path)
    forget_finished(run, 1)  # as the record stands before the done-marker is written
    for name in ("metrics_loop.parquet", MANIFEST_FILE):
        (run.iter_dir(1) / name).unlink()
    (run.iter_dir(1) / "steps.parquet").write_bytes((run.iter_dir(0) / "steps.parquet").read_bytes())
    with pytest.raises(GraftError, match=r"iter_0001/(edges|advantages).parquet: .*not one history"):
        run_loop(run, config, 2, runners=fake_runners([]), prepare=lambda *_: None)
    assert not (run.iter_dir(1) / MANIFEST_FILE).exists()
    assert not (run.iter_dir(1) / "metrics_loop.parquet").exists()


def test_a_finished_iteration_whose_manifest_was_deleted_is_damage_not_an_old_run(tmp_path):
    run, config = _finished_run(tmp_path, iters=3)
    calls: list = []
    for iteration in (0, 2):  # the first: only the run's manifest knows it had one
        manifest = run.iter_dir(iteration) / MANIFEST_FILE
        saved = manifest.read_bytes()
        manifest.unlink()
        with pytest.raises(
            GraftError, match=rf"iter_{iteration:04d}/manifest.json: missing: a finished iteration"
        ):
            run_loop(run, config, 4, runners=fake_runners(calls), prepare=lambda *_: None)
        manifest.write_bytes(saved)
    assert calls == [] and run.iterations() == [0, 1, 2]  # nothing extended


def test_a_run_from_before_manifests_still_resumes(tmp_path):
    run, config = _finished_run(tmp_path)
    for iteration in (0, 1):
        (run.iter_dir(iteration) / MANIFEST_FILE).unlink()
    (run.root / MANIFEST_FILE).unlink()
    calls: list = []
    run_loop(run, config, 3, runners=fake_runners(calls), prepare=lambda *_: None)
    assert [c for c in calls if c[0] == "rollout"] == [("rollout", 2)]
    assert json.loads((run.root / MANIFEST_FILE).read_text())["iterations_from"] == 2
    assert (run.iter_dir(2) / MANIFEST_FILE).is_file()
