"""The training loop, evaluation and configs (docs/design.md §8–9, §11).

Loop mechanics (stage order, skipping, resume, eval schedule, loop metrics) are tested with small
fake stage runners; the end-to-end tests at the bottom run the real stages on a micro config.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from graft_cli.app import app
from schemas import read_table
from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.rundir import STAGES, Run, create_run
from stages.evaluate import episode_table, eval_rows, summary_rows
from stages.loop import eval_due, run_loop
from stages.observe.report import success_standard_error
from tests.helpers.loop_runs import (
    MICRO,
    WALL_CLOCK,
    checkpoint_tensors,
    fake_runners,
    micro_config,
    micro_run,
    run_tables,
)
from tests.helpers.paths import CONFIGS, REPO


def _config(**run_fields) -> Config:
    config = Config()
    for key, value in run_fields.items():
        setattr(config.run, key, value)
    return config


def test_eval_due_schedule() -> None:
    due = [i for i in range(10) if eval_due(i, 9, 4)]
    assert due == [3, 7, 9]  # every 4th iteration and the last one
    assert not any(eval_due(i, 9, 0) for i in range(10))  # eval_every 0 disables it


def test_loop_runs_stages_in_order_and_evaluates_on_schedule(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    config = _config(eval_every=2)
    run = create_run(tmp_path / "r", config)
    results = run_loop(run, config, 3, runners=fake_runners(calls), prepare=lambda *_: None)
    expected = [("eval", -1)]
    for it in range(3):
        expected += [(s, it) for s in STAGES]
        if it in (1, 2):
            expected.append(("eval", it))
    assert calls == expected
    assert [r.iteration for r in results] == [0, 1, 2]
    loop_rows = read_table(run.iter_dir(1) / "metrics_loop.parquet", "metrics")
    names = sorted(loop_rows["name"].to_list())
    assert names == sorted([f"seconds_{s}" for s in (*STAGES, "eval")] + ["seconds_iteration"])
    total = loop_rows.filter(pl.col("name") == "seconds_iteration")["value"][0]
    parts = loop_rows.filter(pl.col("name") != "seconds_iteration")["value"].sum()
    assert total == pytest.approx(parts)
    assert read_table(run.root / "eval.parquet", "eval")["iter"].unique().to_list() == [-1]
    assert read_table(run.table_path(2, "eval"), "eval")["iter"].unique().to_list() == [2]


def test_loop_resumes_after_a_crash_without_redoing_finished_stages(tmp_path: Path) -> None:
    config = _config(eval_every=0)
    run = create_run(tmp_path / "r", config)
    calls: list[tuple[str, int]] = []
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_loop(run, config, 2, runners=fake_runners(calls, crash_at=("graph", 1)), prepare=lambda *_: None)
    assert calls[-1] == ("graph", 1)
    calls.clear()
    run_loop(run, config, 2, runners=fake_runners(calls), prepare=lambda *_: None)
    assert calls == [(s, 1) for s in STAGES[1:]]  # iteration 0 and the rollout of 1 were not redone
    # the resumed iteration still reports the rollout seconds measured before the crash
    names = read_table(run.iter_dir(1) / "metrics_loop.parquet", "metrics")["name"].to_list()
    assert "seconds_rollout" in names
    calls.clear()
    assert run_loop(run, config, 2, runners=fake_runners(calls), prepare=lambda *_: None) == []
    assert calls == []


def test_loop_rejects_a_stage_that_writes_nothing(tmp_path: Path) -> None:
    config = _config(eval_every=0)
    run = create_run(tmp_path / "r", config)
    runners = fake_runners([])
    runners["solve"] = lambda *_: None
    with pytest.raises(GraftError, match="stage solve of iteration 0 finished without"):
        run_loop(run, config, 1, runners=runners, prepare=lambda *_: None)


# ---------------------------------------------------------------------------------------------
# evaluation rows: hand-computed


def test_eval_rows_hand_computed() -> None:
    # three trajectories: a (pick) wins in 2 turns with one invalid action; b (pick) fails in 3 turns;
    # c (heat) wins in 1 turn.
    steps = pl.DataFrame(
        {
            "traj_id": ["a", "a", "b", "b", "b", "c"],
            "task_type": ["pick", "pick", "pick", "pick", "pick", "heat"],
            "step": [0, 1, 0, 1, 2, 0],
            "reward": [-0.1, 0.0, 0.0, -0.1, -0.1, 0.0],
            "outcome": [10.0, 10.0, 0.0, 0.0, 0.0, 10.0],
        }
    )
    rows = eval_rows(steps, 10.0, 4, "iter_0004")
    got = {(r["name"], r["task_type"]): r["value"] for r in rows.iter_rows(named=True)}
    assert got[("success_rate", None)] == pytest.approx(2 / 3)
    assert got[("mean_return", None)] == pytest.approx((9.9 + -0.2 + 10.0) / 3)
    assert got[("mean_turns", None)] == pytest.approx(2.0)
    assert got[("mean_score", None)] == pytest.approx(2 / 3)
    assert got[("episodes", None)] == 3
    assert got[("success_rate", "pick")] == pytest.approx(0.5)
    assert got[("mean_turns", "pick")] == pytest.approx(2.5)
    assert got[("success_rate", "heat")] == 1.0
    assert set(rows["iter"].to_list()) == {4} and set(rows["checkpoint"].to_list()) == {"iter_0004"}
    assert got[("invalid_rate", None)] == 0.0  # no valid column: nothing is known to be invalid
    # an all-invalid model showed only as a return of -0.4; the share of invalid turns
    valid = eval_rows(steps.with_columns(valid=pl.col("reward") == 0.0), 10.0, 4, "iter_0004")
    got = {(r["name"], r["task_type"]): r["value"] for r in valid.iter_rows(named=True)}
    assert got[("invalid_rate", None)] == pytest.approx(3 / 6)  # turns, not episodes
    assert got[("invalid_rate", "pick")] == pytest.approx(3 / 5) and got[("invalid_rate", "heat")] == 0.0


def test_eval_score_column_wins_over_outcome() -> None:
    steps = pl.DataFrame(
        {
            "traj_id": ["a", "a", "b"],
            "task_type": ["", "", ""],
            "step": [0, 1, 0],
            "reward": [0.0, 0.0, 0.0],
            "outcome": [0.0, 0.0, 10.0],
            "score": [0.1, 0.6, 1.0],
        }
    )
    episodes = episode_table(steps, 10.0)
    assert episodes["score"].to_list() == [0.6, 1.0]  # the last step's score of each trajectory
    rows = summary_rows(episodes)
    assert rows.filter((pl.col("name") == "mean_score") & pl.col("task_type").is_null())["value"][0] == 0.8


def test_success_standard_error_from_a_hand_built_eval_table() -> None:
    # five one-turn episodes, three won: p = 0.6, s² = 5·0.6·0.4/4 = 0.3, s.e. = √(0.3/5) = √0.06
    steps = pl.DataFrame(
        {
            "traj_id": ["a", "b", "c", "d", "e"],
            "task_type": ["pick"] * 5,
            "step": [0] * 5,
            "reward": [0.0] * 5,
            "outcome": [10.0, 0.0, 10.0, 10.0, 0.0],
        }
    )
    rows = eval_rows(steps, 10.0, 0, "ck").filter(pl.col("task_type").is_null())
    got = dict(zip(rows["name"], rows["value"], strict=True))
    assert success_standard_error(got["success_rate"], got["episodes"]) == pytest.approx(0.06**0.5)
    assert success_standard_error(1.0, 64) == 0.0 and success_standard_error(0.0, 64) == 0.0
    assert np.isnan(success_standard_error(1.0, 1)) and np.isnan(success_standard_error(0.5, 0))
    # 64 episodes at p = 0.5 (the widest case): 0.063, the resolution the held-out evaluations need
    assert success_standard_error(0.5, 64) == pytest.approx((0.25 / 63) ** 0.5)


@given(st.lists(st.booleans(), min_size=2, max_size=200))
def test_success_standard_error_is_the_sample_std_of_the_episodes_over_root_n(wins: list[bool]) -> None:
    outcomes = np.array(wins, dtype=float)
    reference = outcomes.std(ddof=1) / np.sqrt(len(outcomes))
    assert success_standard_error(outcomes.mean(), len(outcomes)) == pytest.approx(reference, abs=1e-12)


def test_every_benchmark_config_evaluates_at_least_64_episodes_first_and_last() -> None:
    """The paper-scale and benchmark configs evaluate the initial policy and the last checkpoint on
    at least 64 held-out episodes, so a change of 0.1 in held-out success is about 2 s.e."""
    for path in sorted(CONFIGS.glob("*.toml")):  # configs/cpu/* are smoke configs, not benchmarks
        config = load_config(path)
        episodes = config.env.eval_tasks * config.eval.group_size
        assert episodes >= 64, (path.name, episodes)
        assert config.eval.initial and config.run.eval_every > 0, path.name
        assert eval_due(config.run.iters - 1, config.run.iters - 1, config.run.eval_every), path.name
    long = load_config(CONFIGS / "household_long.toml")
    assert (long.env.eval_tasks, long.eval.group_size, long.eval.temperature) == (16, 4, 0.4)


# ---------------------------------------------------------------------------------------------
# configs and the CLI's run handling


def test_every_shipped_config_loads() -> None:
    files = sorted(CONFIGS.glob("*.toml"))
    assert {f.stem for f in files} >= {"quickstart", "alfworld", "textworld", "shop", "search"}
    envs = {f.stem: load_config(f).env.name for f in files}
    assert envs["quickstart"] == "household" and envs["alfworld"] == "alfworld" and envs["search"] == "search"


def test_paper_values_in_configs() -> None:
    alf, shop, search = (load_config(CONFIGS / f"{n}.toml") for n in ("alfworld", "shop", "search"))
    assert (alf.rollout.groups, alf.rollout.group_size, alf.env.max_turns) == (16, 8, 50)
    assert (shop.env.max_turns, shop.advantage.lam, shop.update.minibatch_size) == (15, 0.8, 64)
    assert (search.rollout.group_size, search.env.max_turns, search.update.beta) == (5, 4, 0.001)
    assert (search.graph.canonicalize, search.graph.tau, search.eval.temperature) == ("similarity", 0.9, 0.0)
    for c in (alf, shop, search):
        assert c.update.lr == 1e-6 and c.rollout.temperature == 1.0 and c.solve.gamma == 0.99


def test_changed_config_is_refused_but_iters_is_not_a_change(tmp_path: Path, monkeypatch) -> None:
    from stages.loop.start import resolve_loop_run

    run_dir = str(tmp_path / "r")
    cfg_path = CONFIGS / "quickstart.toml"
    run, config, target = resolve_loop_run(str(cfg_path), run_dir, [], 3, False)
    assert target == 3 and load_config(run.config_path).run.iters == 3
    run, config, target = resolve_loop_run(str(cfg_path), run_dir, [], 5, False)  # extending is fine
    assert target == 5 and load_config(run.config_path).run.iters == 5
    result = CliRunner().invoke(
        app, ["loop", "--config", str(cfg_path), "--run", run_dir, "--set", "update.lr=0.5", "--iters", "0"]
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.strip().splitlines() if line]
    assert len(lines) == 1 and "update.lr" in lines[0] and "--force" in lines[0]


# ---------------------------------------------------------------------------------------------
# end to end with the real stages on a micro config (tiny model hidden 32, 1 layer; 2 groups x 2
# rollouts; 4 turns); the killed-and-resumed run must end with the same tables as an uninterrupted one


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    return micro_run(tmp_path_factory.mktemp("ref"))


@pytest.mark.slow
def test_two_iteration_loop_end_to_end(reference_run: Path) -> None:
    from schemas import TABLES
    from schemas.rundir import open_run

    run = open_run(reference_run)
    for it in (0, 1):
        for table in ("steps", "nodes", "edges", "values", "advantages", "update", "eval"):
            frame = read_table(run.table_path(it, table), table)  # name, version, columns, types
            assert frame.height > 0, (it, table)
        for stage in ("rollout", "graph", "solve", "advantage", "update", "loop"):
            rows = read_table(run.iter_dir(it) / f"metrics_{stage}.parquet", "metrics")
            assert set(rows["iter"].to_list()) == {it}
    assert set(TABLES) >= {"steps", "eval"}
    # the checkpoint advances: iteration i acts with the checkpoint of i-1, and an update changes the
    # weights exactly when its advantages are not all zero (beta = 0: no KL pull)
    assert run.latest_checkpoint().name == "iter_0001"
    assert set(run.read(0, "steps")["policy_version"].to_list()) == {"initial"}
    assert set(run.read(1, "steps")["policy_version"].to_list()) == {"iter_0000"}
    from safetensors.torch import load_file

    before = load_file(next(run.initial_model_dir.glob("*.safetensors")))
    for it in (0, 1):
        after = load_file(next(run.checkpoint_dir(it).glob("*.safetensors")))
        moved = any(not (before[k] == after[k]).all() for k in before)
        assert moved == bool((run.read(it, "advantages")["advantage"] != 0).any()), it
        before = after
    # eval rows: the initial policy and every iteration (eval_every = 1), overall and per type
    initial_eval = read_table(run.root / "eval.parquet", "eval")
    assert set(initial_eval["iter"].to_list()) == {-1}
    for it in (0, 1):
        ev = read_table(run.table_path(it, "eval"), "eval")
        overall = ev.filter(pl.col("task_type").is_null())
        assert set(overall["name"].to_list()) == {
            "success_rate",
            "mean_return",
            "mean_turns",
            "mean_score",
            "invalid_rate",
            "valid_action_rate",
            "episodes",
        }
        assert overall.filter(pl.col("name") == "episodes")["value"][0] == 2.0  # eval_tasks x eval.group_size


KILLS = [
    "eval:-1",
    "rollout:0",
    "graph:0",
    "solve:0",
    "advantage:0",
    "update:0:checkpoints",
    "eval:0",
    "update:1",
]


def _killed_child(run_dir: str, spec: str) -> None:  # runs in a forkserver child
    import os

    from schemas.rundir import create_run as _create
    from tests.helpers.kill_at import killing_runners

    config = micro_config()
    run_loop(_create(run_dir, config), config, config.run.iters, runners=killing_runners(spec))
    os._exit(0)  # the kill did not fire


@pytest.mark.slow
def test_sigkill_in_every_stage_resumes_to_the_same_tables(reference_run: Path, tmp_path: Path) -> None:
    import multiprocessing
    import os
    import signal
    import subprocess
    import sys

    run_dir = tmp_path / "killed"
    # forkserver, not fork: polars' thread pool deadlocks in a child forked from a process that used it;
    # the server imports the stages once, so each child starts in milliseconds
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.loop.test_loop", "tests.helpers.kill_at", "stages.loop"])
    for spec in KILLS:
        child = ctx.Process(target=_killed_child, args=(str(run_dir), spec))
        child.start()
        child.join(120)
        assert child.exitcode == -signal.SIGKILL, f"{spec}: child exit code {child.exitcode}"
    assert any(run_dir.rglob(".*.tmp")), "a kill mid-write leaves a temporary file"
    # the last resume runs in a fresh interpreter (its own hash seed) through the real CLI
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "graft_cli", "loop", "--config", str(CONFIGS / "quickstart.toml"),
           "--run", str(run_dir), *[a for s in MICRO for a in ("--set", s)]]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "training success" in done.stdout and (run_dir / "report" / "curves.png").is_file()
    assert not any(run_dir.rglob(".*.tmp"))  # stale temporaries were cleaned up on resume
    want, got = run_tables(reference_run), run_tables(run_dir)
    assert sorted(got) == sorted(want)
    for name, frame in want.items():
        assert got[name].equals(frame), name
    a, b = checkpoint_tensors(reference_run), checkpoint_tensors(run_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        for key in a[name]:
            assert (a[name][key] == b[name][key]).all(), (name, key)


@pytest.mark.slow
def test_graft_eval_reproduces_the_loops_evaluation(reference_run: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(reference_run, copy)
    (copy / "iter_0001" / "eval.parquet").unlink()
    result = CliRunner().invoke(app, ["eval", str(copy), "--iter", "1"])
    assert result.exit_code == 0, result.output
    assert "success" in result.output
    again = read_table(copy / "iter_0001" / "eval.parquet", "eval")
    assert again.equals(read_table(reference_run / "iter_0001" / "eval.parquet", "eval"))
    result = CliRunner().invoke(app, ["eval", str(copy), "--checkpoint", "latest"])
    assert result.exit_code == 2 and "iter_0001 is already evaluated; use --force" in result.output
    result = CliRunner().invoke(app, ["eval", str(copy), "--checkpoint", "latest", "--force"])
    assert result.exit_code == 0 and "iter_0001" in result.output
    result = CliRunner().invoke(app, ["eval", str(copy), "--iter", "7"])
    assert result.exit_code == 2 and "no complete checkpoint for iteration 7" in result.output


def test_graft_eval_of_iteration_minus_one_is_the_initial_policy_like_the_loops(tmp_path: Path) -> None:
    from stages.evaluate.target import resolve_eval_target

    run = create_run(tmp_path / "run", Config())
    expected = (-1, run.initial_model_dir, "initial", run.root / "eval.parquet")
    assert resolve_eval_target(run, Config(), "latest", -1) == expected
    assert resolve_eval_target(run, Config(), "initial", None) == expected


def test_graft_eval_refuses_a_checkpoint_whose_rows_would_replace_the_initial_episodes(
    tmp_path: Path,
) -> None:
    """``graft eval --checkpoint DIR`` writes eval_<DIR name>.parquet at the run's top: a directory named
    ``episodes`` would overwrite the initial evaluation's eval_episodes.parquet, so it is refused."""
    from stages.evaluate.target import resolve_eval_target

    run = create_run(tmp_path / "run", Config())
    for name in ("episodes", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    _, _, _, out = resolve_eval_target(run, Config(), str(tmp_path / "other"), None)
    assert out == run.root / "eval_other.parquet"
    with pytest.raises(GraftError, match="named 'episodes' cannot be evaluated here"):
        resolve_eval_target(run, Config(), str(tmp_path / "episodes"), None)


def test_graft_eval_refuses_an_iteration_below_minus_one(tmp_path: Path) -> None:
    run = create_run(tmp_path / "run", load_config(None, ["run.eval_every=0"]))
    result = CliRunner().invoke(app, ["eval", str(run.root), "--iter", "-3"])
    assert result.exit_code == 2 and "--iter must be >= 0 (or -1" in result.output


def test_readme_rule_on_wall_clock_names_covers_every_timing_metric() -> None:
    """docs/loop.md's globs for wall-clock metric names match exactly the timing names its table lists."""
    import fnmatch
    import re

    readme = (REPO / "docs" / "loop.md").read_text()
    rule = re.search(r"wall-clock ones\s*\(([^)]*)\)", readme)
    assert rule, "docs/loop.md states which metric names are wall-clock"
    globs = re.findall(r"`([^`]*\*[^`]*)`", rule.group(1))
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    names = {n for line in table for n in re.findall(r"`([a-z][a-z0-9_]*)`", line.split("|")[2])}
    assert {"ref_seconds", "old_seconds", "tokens_per_s", "seconds_iteration"} <= names
    for name in names:
        timing = re.search(WALL_CLOCK, name) is not None
        assert any(fnmatch.fnmatch(name, g) for g in globs) == timing, name


@pytest.mark.slow
def test_releasing_the_engine_before_the_update_changes_no_table(reference_run: Path, tmp_path: Path) -> None:
    # the loop kept the rollout engine resident through the update and evaluation
    import stages.policy.live_engine as engines
    from stages.loop import STAGE_RUNNERS

    config = load_config(CONFIGS / "quickstart.toml", [*MICRO, "rollout.release_engine=always"])
    run = create_run(tmp_path / "released", config)
    live_at_update = []

    def update(r: Run, it: int, c: Config) -> None:
        live_at_update.append(len(engines._ENGINES))
        STAGE_RUNNERS["update"](r, it, c)

    run_loop(run, config, config.run.iters, runners={**STAGE_RUNNERS, "update": update})
    assert live_at_update == [0, 0]
    want, got = run_tables(reference_run), run_tables(run.root)
    assert sorted(got) == sorted(want)
    for name, frame in want.items():
        assert got[name].equals(frame), name
    auto = load_config(CONFIGS / "quickstart.toml", MICRO)
    assert not engines.engine_released_for_update(auto)  # a CPU run keeps its engine (no memory to free)


@pytest.mark.slow
def test_a_larger_evaluation_changes_no_training_table(reference_run: Path, tmp_path: Path) -> None:
    """The evaluation plays on its own seed stream: three episodes per held-out task instead of one
    leave every steps, graph, solve, advantage, update and checkpoint output as it was, and the initial
    and the last evaluation each play eval_tasks × group_size episodes."""
    config = load_config(CONFIGS / "quickstart.toml", [*MICRO, "eval.group_size=3"])
    run = create_run(tmp_path / "larger_eval", config)
    run_loop(run, config, config.run.iters)
    want, got = run_tables(reference_run), run_tables(run.root)
    assert sorted(got) == sorted(want)
    evals = {name for name in want if name.split("/")[-1] in ("eval.parquet", "eval_episodes.parquet")}
    assert evals == {
        f"{folder}{table}.parquet"
        for folder in ("", "iter_0000/", "iter_0001/")
        for table in ("eval", "eval_episodes")
    }
    for name, frame in want.items():
        if name not in evals:
            assert got[name].equals(frame), name
    for name in ("eval.parquet", "iter_0001/eval.parquet"):  # the initial policy and the last checkpoint
        overall = got[name].filter(pl.col("task_type").is_null() & (pl.col("name") == "episodes"))
        assert overall["value"].to_list() == [config.env.eval_tasks * 3]
        before = want[name].filter(pl.col("task_type").is_null() & (pl.col("name") == "episodes"))
        assert before["value"].to_list() == [config.env.eval_tasks * 1]
        # one row per episode beside it, each task played three times
        episodes = got[name.replace("eval.parquet", "eval_episodes.parquet")]
        assert episodes.group_by("task_id").len()["len"].to_list() == [3] * config.env.eval_tasks
    a, b = checkpoint_tensors(reference_run), checkpoint_tensors(run.root)
    assert sorted(a) == sorted(b)
    for name in a:
        for key in a[name]:
            assert (a[name][key] == b[name][key]).all(), (name, key)
