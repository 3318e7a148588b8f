"""Your own environment: env.name = "module:Class" or a graft.environments entry point;
the example in examples/corridor_env.py runs through a loop iteration with the tiny model."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from graft_cli.app import app
from schemas.errors import GraftError
from stages.envs.base import Episode
from stages.envs.registry import make_env
from tests.helpers.examples import CORRIDOR_ENV


def test_the_example_plugs_in_and_its_expert_wins(examples_on_path) -> None:
    env = make_env(CORRIDOR_ENV, max_turns=10, invalid_penalty=-0.1, data="", length=3)
    assert type(env).__name__ == "Corridor" and env.length == 3
    tasks = env.tasks("train", 5, 0)
    assert tasks == env.tasks("train", 5, 0) and tasks != env.tasks("eval", 5, 0)
    for task in tasks:
        episode = Episode(env, task)
        while not episode.done:
            episode.act(episode.game.expert_action())
        # the expert walks straight east: exactly `goal` turns, then the outcome R = 10
        assert episode.won and episode.turn == task.spec["goal"] and episode.outcome == 10.0


@pytest.mark.slow
def test_the_example_runs_one_loop_iteration_with_the_tiny_model(examples_on_path, tmp_path: Path) -> None:
    import torch

    from schemas.config import load_config
    from schemas.rundir import create_run
    from stages.loop import run_loop
    from tests.helpers.loop_runs import MICRO
    from tests.helpers.paths import CONFIGS

    torch.set_num_threads(1)
    config = load_config(
        CONFIGS / "quickstart.toml",
        [*MICRO, "run.iters=1", f"env.name={CORRIDOR_ENV}", "env.options={length = 2}"],
    )
    run = create_run(tmp_path / "corridor", config)
    results = run_loop(run, config, 1)
    assert [r.iteration for r in results] == [0]
    steps = run.read(0, "steps")
    assert steps["task_id"].str.starts_with("corridor-train-").all()
    assert set(steps["action"].to_list()) <= {"go east", "go west"}
    assert run.stage_complete("update", 0) and run.stage_complete("eval", 0)
    ev = run.read(0, "eval").filter(pl.col("task_type").is_null() & (pl.col("name") == "episodes"))
    assert ev["value"][0] == config.env.eval_tasks * config.eval.group_size


class NoTasks:
    """A plug-in that forgot tasks() and success_outcome, and whose games cannot step."""

    name, prompt_style, max_turns, invalid_penalty = "broken", "alfworld", 5, -0.1

    def __init__(self, **_: object) -> None:
        pass

    def new_game(self) -> object:
        return object()

    def failure_outcome(self, score: float) -> float:
        return 0.0


class BadStyle(NoTasks):
    prompt_style = "poetry"
    success_outcome = 1.0

    def tasks(self, split: str, count: int, seed: int) -> list:
        return []


def test_missing_attributes_are_one_error_naming_all_of_them() -> None:
    with pytest.raises(GraftError) as info:
        make_env("tests.envs.test_env_plugin:NoTasks", max_turns=5)
    message = str(info.value)
    assert "tasks() is missing" in message and "success_outcome is missing" in message
    assert "docs/environments.md" in message and "\n" not in message
    with pytest.raises(GraftError, match=r"prompt_style 'poetry' is not one of alfworld, webshop, search"):
        make_env("tests.envs.test_env_plugin:BadStyle")


def test_a_game_without_its_methods_is_refused() -> None:
    class GoodEnvBadGame(BadStyle):
        prompt_style = "alfworld"

    import tests.envs.test_env_plugin as me

    me.GoodEnvBadGame = GoodEnvBadGame  # type: ignore[attr-defined]
    try:
        with pytest.raises(GraftError, match=r"returns a game without reset\(\); .* without step\(\)"):
            make_env("tests.envs.test_env_plugin:GoodEnvBadGame")
    finally:
        del me.GoodEnvBadGame  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("no_such_module_xyz:Env", {}, "cannot import module 'no_such_module_xyz'"),
        ("corridor_env:Nope", {}, "module 'corridor_env' has no attribute 'Nope'"),
        ("corridor_env:random", {}, "is not a class or factory function"),  # a module
        (CORRIDOR_ENV, {"colour": "red"}, "cannot be called with colour"),
        (CORRIDOR_ENV, {"length": 0}, "option 'length' = 0 must be an int >= 1"),
        ("nowhere", {}, "unknown environment 'nowhere'; environments: alfworld, household"),
    ],
)
def test_bad_plugins_are_one_clear_error(examples_on_path, name: str, options: dict, expected: str) -> None:
    with pytest.raises(GraftError, match=expected.replace("(", r"\(")):
        make_env(name, **options)


def test_an_entry_point_names_a_plugin(examples_on_path, monkeypatch, tmp_path: Path) -> None:
    dist = tmp_path / "my_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[graft.environments]\ncorridor = corridor_env:Corridor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("corridor", length=2)
    assert type(env).__name__ == "Corridor" and env.length == 2


def test_the_cli_reports_a_broken_plugin_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["init-model", str(tmp_path / "m"), "--tiny", "--env", "tests.envs.test_env_plugin:NoTasks"]
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: env.name 'tests.envs.test_env_plugin:NoTasks'")
    assert not (tmp_path / "m").exists()
