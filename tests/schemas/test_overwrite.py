"""Stage commands never silently overwrite: a finished stage is refused without
--force; with --force everything computed from it is removed first, so the run stays one history."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.config import Config
from schemas.errors import GraftError
from schemas.recompute import guard_recompute
from schemas.rundir import STAGES, Run, create_run
from stages.loop import run_loop
from tests.helpers.loop_runs import fake_runners


def _finished_run(root: Path, iters: int = 3, eval_every: int = 1) -> Run:
    config = Config()
    config.run.eval_every = eval_every
    run = create_run(root, config)
    run_loop(run, config, iters, runners=fake_runners([]), prepare=lambda *_: None)
    return run


def _listing(run: Run) -> dict[str, int]:
    return {
        str(p.relative_to(run.root)): p.stat().st_mtime_ns
        for p in sorted(run.root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_dependents_are_later_stages_then_later_iterations_newest_first(tmp_path: Path) -> None:
    run = _finished_run(tmp_path / "r")
    rel = [str(p.relative_to(run.root)) for p in run.dependent_outputs("graph", 1)]
    # later iterations first (newest first), so a crash while removing leaves a consistent prefix
    assert rel[:2] == ["iter_0002", "checkpoints/iter_0002"]
    inside = rel[2:]
    assert inside[0] == "iter_0001/metrics_loop.parquet"  # the done-marker goes before any output
    expected = ["eval.parquet", "update.parquet", "advantages.parquet", "values.parquet"]
    positions = [inside.index(f"iter_0001/{name}") for name in expected]
    assert positions == sorted(positions)  # newest stage first
    assert "checkpoints/iter_0001" in inside
    assert not any(r.endswith(("steps.parquet", "nodes.parquet", "edges.parquet")) for r in inside)
    assert not any(r.startswith(("iter_0000", "checkpoints/iter_0000")) for r in rel)
    # nothing is computed from an evaluation; the last iteration's update has only its eval after it
    assert run.dependent_outputs("eval", 0) == []
    last = [str(p.relative_to(run.root)) for p in run.dependent_outputs("update", 2)]
    assert set(last) == {
        "iter_0002/metrics_loop.parquet",
        "iter_0002/.loop_seconds.json",
        "iter_0002/manifest.json",  # the finished iteration's manifest goes with its done-marker
        "iter_0002/eval.parquet",
    }


@pytest.mark.parametrize("stage", [*STAGES, "eval"])
def test_a_finished_stage_is_refused_without_force_and_nothing_changes(tmp_path: Path, stage: str) -> None:
    run = _finished_run(tmp_path / "r")
    before = _listing(run)
    with pytest.raises(GraftError, match=rf"{stage} of iteration 1 is finished; use --force"):
        guard_recompute(run, stage, 1, force=False)
    assert _listing(run) == before


def test_force_removes_the_dependents_and_the_loop_redoes_exactly_them(tmp_path: Path) -> None:
    run = _finished_run(tmp_path / "r")
    kept = {k: v for k, v in _listing(run).items() if k.startswith("iter_0000") or k == "eval.parquet"}
    removed = guard_recompute(run, "solve", 1, force=True)
    assert removed and not any(p.exists() for p in removed)
    assert not (run.root / "iter_0002").exists() and not run.checkpoint_dir(1).exists()
    assert run.stage_complete("graph", 1) and run.stage_complete("solve", 1)  # the stage's own output stays
    now = _listing(run)
    assert {k: now[k] for k in kept} == kept  # earlier iterations untouched
    calls: list[tuple[str, int]] = []
    config = run.load_config()
    run_loop(run, config, 3, runners=fake_runners(calls), prepare=lambda *_: None)
    assert calls == [("advantage", 1), ("update", 1), ("eval", 1), *[(s, 2) for s in (*STAGES, "eval")]]


def test_a_stage_with_later_outputs_is_refused_even_when_its_own_output_is_gone(tmp_path: Path) -> None:
    run = _finished_run(tmp_path / "r", iters=2)
    run.table_path(0, "steps").unlink()  # e.g. deleted by hand: replaying it would orphan the graph
    with pytest.raises(
        GraftError,
        match=r"rollout of iteration 0 has later outputs; use --force .*nodes.parquet.*iteration 1 with",
    ):
        guard_recompute(run, "rollout", 0, force=False)


def _one_error_line(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ["rollout", "{run}", "--iter", "0", "--set", "rollout.temperature=0.5"],
        ["graph", "{run}", "--iter", "0"],
        ["solve", "{run}", "--iter", "1"],
        ["advantage", "{run}", "--iter", "1", "--set", "graph.canonicalize=similarity"],
        ["update", "{run}", "--iter", "0"],
        ["eval", "{run}", "--iter", "1"],
        ["eval", "{run}", "--iter", "-1"],
    ],
)
def test_stage_commands_refuse_a_finished_iteration(
    tmp_path: Path, runner: CliRunner, args: list[str]
) -> None:
    run = _finished_run(tmp_path / "r", iters=2)
    before = _listing(run)
    result = runner.invoke(app, [a.format(run=run.root) for a in args])
    line = _one_error_line(result)
    assert "--force" in line
    assert _listing(run) == before


def test_advantage_with_a_new_graph_setting_guards_the_graph(tmp_path: Path, runner: CliRunner) -> None:
    run = _finished_run(tmp_path / "r", iters=2)
    run.table_path(1, "advantages").unlink()
    for name in ("update.parquet", "eval.parquet", "metrics_loop.parquet"):
        (run.iter_dir(1) / name).unlink()
    shutil.rmtree(run.checkpoint_dir(1))
    # advantages of iteration 1 are missing, but --set graph.* would rebuild its finished graph
    result = runner.invoke(app, ["advantage", str(run.root), "--iter", "1", "--set", "graph.tau=0.5"])
    assert "graph of iteration 1 is finished" in _one_error_line(result)


def test_rollout_force_does_not_combine_with_shard(tmp_path: Path, runner: CliRunner) -> None:
    run = _finished_run(tmp_path / "r", iters=1)
    result = runner.invoke(app, ["rollout", str(run.root), "--iter", "0", "--shard", "0/2", "--force"])
    assert "--shard" in _one_error_line(result)


@pytest.mark.slow
def test_forced_replay_then_loop_ends_with_the_uninterrupted_tables(tmp_path_factory, tmp_path: Path) -> None:
    """A forced replay with the real stages: replaying iteration 1's rollout removes its credit,
    update and evaluation; the loop then redoes exactly those and ends where an untouched run is."""
    from tests.helpers.loop_runs import checkpoint_tensors, micro_config, micro_run, run_tables

    reference = micro_run(tmp_path_factory.mktemp("ref"))
    copy = tmp_path / "copy"
    shutil.copytree(reference, copy)
    runner = CliRunner()
    refused = runner.invoke(app, ["rollout", str(copy), "--iter", "1", "--no-progress"])
    assert "rollout of iteration 1 is finished" in _one_error_line(refused)
    done = runner.invoke(app, ["rollout", str(copy), "--iter", "1", "--no-progress", "--force"])
    assert done.exit_code == 0, done.output
    assert "removed what was computed from it: iter_0001/{" in done.output
    run = Run(copy)
    assert run.stage_complete("rollout", 1) and not run.stage_complete("graph", 1)
    assert not run.checkpoint_dir(1).exists() and run.stage_complete("update", 0)
    config = micro_config()
    results = run_loop(run, config, config.run.iters)
    assert [(r.iteration, r.skipped) for r in results] == [(1, ["rollout"])]
    want, got = run_tables(reference), run_tables(copy)
    assert sorted(got) == sorted(want)
    for name, frame in want.items():
        assert got[name].equals(frame), name
    a, b = checkpoint_tensors(reference), checkpoint_tensors(copy)
    assert sorted(a) == sorted(b)
    for name in a:
        for key in a[name]:
            assert (a[name][key] == b[name][key]).all(), (name, key)


def test_force_that_would_remove_later_iterations_asks_first(tmp_path: Path) -> None:
    # `graft rollout RUN --force` (no --iter) meant iteration 0 and deleted every
    # iteration and checkpoint without asking
    from schemas.config import Config
    from schemas.rundir import create_run
    from stages.loop import run_loop
    from tests.helpers.loop_runs import fake_runners

    config = Config()
    config.run.eval_every = 0
    run = create_run(tmp_path / "r", config)
    run_loop(run, config, 3, runners=fake_runners([]), prepare=lambda *_: None)
    runner = CliRunner()
    no_iter = runner.invoke(app, ["rollout", str(run.root), "--force"])
    assert no_iter.exit_code == 2 and "give --iter I" in _one_error_line(no_iter)
    for command in (
        ["graph", str(run.root), "--iter", "0", "--force"],
        ["update", str(run.root), "--iter", "1", "--force"],
    ):
        refused = runner.invoke(app, command)  # CliRunner's stdin is no terminal: no --yes, no removal
        assert refused.exit_code == 2 and "--force not confirmed; nothing was removed" in refused.output
        assert "pass --yes" in refused.output
        assert run.iterations() == [0, 1, 2] and run.checkpoint_iterations() == [0, 1, 2]
    said_no = runner.invoke(app, ["solve", str(run.root), "--iter", "1", "--force"], input="n\n")
    assert said_no.exit_code == 2 and run.iterations() == [0, 1, 2]
    from graft_cli.commands.confirm import removal_confirmer

    assert removal_confirmer(False)("iterations 1..2") is False  # no terminal to ask on
    assert removal_confirmer(True)("iterations 1..2") is True
    done = runner.invoke(app, ["graph", str(run.root), "--iter", "1", "--force", "--yes"])
    assert done.exit_code == 0, done.output
    assert "iteration 2 with their checkpoints" in done.output and run.iterations() == [0, 1]


def test_stage_command_overrides_are_recorded_in_the_iteration(tmp_path: Path) -> None:
    # iteration 7 ran grpo through --set, and nothing in the run said so
    import json

    from schemas.config import Config
    from schemas.rundir import create_run
    from stages.credit.synth import synth_steps

    run = create_run(tmp_path / "r", Config())
    run.write(0, "steps", synth_steps(groups=2, group_size=3, horizon=4, seed=1))
    runner = CliRunner()
    done = runner.invoke(
        app, ["advantage", str(run.root), "--iter", "0", "--set", "advantage.estimator=grpo"]
    )
    assert done.exit_code == 0, done.output
    recorded = json.loads((run.iter_dir(0) / "overrides_advantage.json").read_text())
    assert recorded == {"stage": "advantage", "set": ["advantage.estimator=grpo"]}
    # the missing graph and values were computed by the same command, with the same --set
    assert json.loads((run.iter_dir(0) / "overrides_graph.json").read_text())["set"] == recorded["set"]
    again = runner.invoke(app, ["advantage", str(run.root), "--iter", "0", "--force"])
    assert again.exit_code == 0, again.output
    assert not (run.iter_dir(0) / "overrides_advantage.json").exists()  # recomputed as config.toml says


def test_force_checks_the_tables_it_keeps_before_removing_anything(tmp_path: Path, runner: CliRunner) -> None:
    # a replaced steps table, then `advantage --force --yes`: it used to remove iteration 1's update and
    # checkpoint and iterations 2-3, then fail on "edges has 75 rows but steps has 67"
    from stages.credit.synth import synth_steps

    run = _finished_run(tmp_path / "r", iters=3)
    run.write(1, "steps", synth_steps(groups=3, group_size=3, horizon=5, seed=5, success_reward=10.0))
    before = _listing(run)
    result = runner.invoke(app, ["advantage", str(run.root), "--iter", "1", "--force", "--yes"])
    line = _one_error_line(result)
    assert f"{run.iter_dir(1)}/steps.parquet: size differs from the finished iteration's manifest" in line
    assert f"graft rollout {run.root} --iter 1 --force" in line and line.endswith("--force removed nothing")
    assert _listing(run) == before


def test_force_checks_the_input_tables_against_each_other_without_a_manifest(
    tmp_path: Path, runner: CliRunner
) -> None:
    from stages.credit.synth import synth_steps

    run = create_run(tmp_path / "r", Config())
    run.write(0, "steps", synth_steps(groups=2, group_size=3, horizon=4, seed=1))
    assert runner.invoke(app, ["advantage", str(run.root), "--iter", "0"]).exit_code == 0
    run.write(0, "steps", synth_steps(groups=2, group_size=3, horizon=6, seed=2))  # not what the graph saw
    before = _listing(run)
    line = _one_error_line(runner.invoke(app, ["advantage", str(run.root), "--iter", "0", "--force"]))
    assert f"{run.iter_dir(0)}/edges.parquet: has " in line and "rows but steps.parquet has" in line
    assert line.endswith("--force removed nothing") and _listing(run) == before


@pytest.mark.slow
def test_force_says_when_the_optimizer_state_to_restore_was_dropped(tmp_path_factory, tmp_path: Path) -> None:
    from schemas.integrity import TRAINER_STATE_DIR, forget_checkpoint_files
    from tests.helpers.loop_runs import micro_run

    copy = tmp_path / "copy"
    shutil.copytree(micro_run(tmp_path_factory.mktemp("ref")), copy)
    run = Run(copy)
    forget_checkpoint_files(run.checkpoint_dir(0), TRAINER_STATE_DIR)  # as retention does
    shutil.rmtree(run.checkpoint_dir(0) / TRAINER_STATE_DIR)
    runner = CliRunner()
    before = _listing(run)
    for command in (
        ["update", str(copy), "--iter", "1", "--force"],
        ["graph", str(copy), "--iter", "1", "--force"],
    ):
        line = _one_error_line(runner.invoke(app, command))
        assert f"{run.checkpoint_dir(0)}: its optimizer state (trainer_state/) was dropped" in line
        assert "cannot reproduce the original" in line and "nothing was removed (pass --yes" in line
        assert _listing(run) == before
    first = runner.invoke(
        app, ["update", str(copy), "--iter", "0", "--force"]
    )  # starts from no optimizer state
    assert "--force removes" in _one_error_line(first) and "optimizer state" not in first.output
    done = runner.invoke(app, ["update", str(copy), "--iter", "1", "--force", "--yes"])
    assert done.exit_code == 0, done.output
