"""One way to run a stage (stages/loop/stage.py): the loop and the stage commands both go through
``run_stage``, which guards, prepares the initial policy by one rule, runs the runner, checks its
outputs and records a command's ``--set`` items."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.config import Config
from schemas.errors import GraftError
from schemas.rundir import STAGE_NAMES, Run, create_run
from stages.loop import StageCommand, run_loop, run_stage, uses_initial_policy
from tests.helpers.loop_runs import fake_runners


def _run(tmp_path: Path) -> tuple[Run, Config]:
    config = Config()
    config.run.eval_every = 1
    return create_run(tmp_path / "r", config), config


def test_the_initial_policy_rule_by_hand() -> None:
    # acts with it: the rollout of iteration 0; trains against it: every update; scores it: eval of -1
    want = {
        ("rollout", 0): True, ("rollout", 1): False, ("graph", 0): False, ("solve", 0): False,
        ("advantage", 0): False, ("update", 0): True, ("update", 5): True, ("eval", -1): True,
        ("eval", 0): False, ("eval", 3): False,
    }  # fmt: skip
    assert {key: uses_initial_policy(*key) for key in want} == want
    assert {s for s, _ in want} == set(STAGE_NAMES)  # every stage of the table is covered


def test_the_loop_prepares_the_initial_policy_where_the_rule_says(tmp_path: Path) -> None:
    run, config = _run(tmp_path)
    config.eval.initial = True
    calls: list[tuple[str, int]] = []
    runners = fake_runners(calls)
    prepared: list[tuple[str, int]] = []

    def prepare(run: Run, config: Config) -> None:  # which stage ran last when it was called
        prepared.append(calls[-1] if calls else ("start", -1))

    run_loop(run, config, 2, runners=runners, prepare=prepare)
    # before the initial evaluation, the rollout of iteration 0 and each update; not the rollout of 1
    assert prepared == [("start", -1), ("eval", -1), ("advantage", 0), ("advantage", 1)]


def test_a_runner_that_writes_nothing_fails_for_the_loop_and_the_commands(tmp_path: Path) -> None:
    run, config = _run(tmp_path)
    runners = fake_runners([])
    runners["rollout"](run, 0, config)

    def silent(run: Run, it: int, config: Config) -> None:
        pass

    for command in (None, StageCommand()):
        with pytest.raises(GraftError, match=r"stage graph of iteration 0 finished without .*nodes\.parquet"):
            run_stage(run, "graph", 0, config, runner=silent, command=command)


def test_a_command_is_guarded_and_records_its_overrides(tmp_path: Path) -> None:
    run, config = _run(tmp_path)
    runners = fake_runners([])
    for stage in ("rollout", "graph", "solve", "advantage"):
        done = run_stage(
            run, stage, 0, config, runner=runners[stage], command=StageCommand(overrides=["a.b=1"])
        )
        assert done.removed == []
    recorded = json.loads((run.iter_dir(0) / "overrides_solve.json").read_text())
    assert recorded == {"stage": "solve", "set": ["a.b=1"]}
    # finished: refused without --force, and with it what was computed from it goes first
    with pytest.raises(GraftError, match="graph of iteration 0 is finished; use --force"):
        run_stage(run, "graph", 0, config, runner=runners["graph"], command=StageCommand())
    done = run_stage(run, "graph", 0, config, runner=runners["graph"], command=StageCommand(force=True))
    assert {p.name for p in done.removed} >= {"values.parquet", "advantages.parquet"}
    assert not (run.iter_dir(0) / "overrides_graph.json").exists()  # this call set nothing
    assert not run.stage_complete("solve", 0)


def test_a_command_names_the_stage_to_run_first(tmp_path: Path) -> None:
    run, config = _run(tmp_path)
    runners = fake_runners([])
    runners["rollout"](run, 0, config)
    with pytest.raises(
        GraftError,
        match=r"solve: iteration 0 of .* has no graph yet \(no .*nodes\.parquet\); run graft graph .* --iter 0",
    ):
        run_stage(run, "solve", 0, config, runner=runners["solve"], command=StageCommand())
