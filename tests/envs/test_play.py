"""``graft play``: a person (here: stdin) plays an environment in the terminal."""

from __future__ import annotations

from typer.testing import CliRunner

from graft_cli.app import app
from stages.envs.registry import make_env

runner = CliRunner()


def test_household_expert_commands_win():
    result = runner.invoke(app, ["play", "household", "--task", "2", "--seed", "1"], input="expert\n" * 20)
    assert result.exit_code == 0, result.output
    task = make_env("household").tasks("train", 3, 1)[2]
    assert f"Task: {task.spec['text']}" in result.output
    assert "episode over (won): won True, outcome 10" in result.output
    assert "expert: go to" in result.output and "  1. go to" in result.output


def test_numbers_text_and_invalid_actions_on_shop():
    env = make_env("shop", types=3)
    task = env.tasks("eval", 1, 0)[0]
    game = env.new_game()
    first = game.reset(task)
    number = first.admissible.index(f"search[{task.spec['goal']['type']}]") + 1
    lines = ["click[buy now]", str(number), "99", "help", "CLICK[Back to Search]", "quit"]
    result = runner.invoke(
        app,
        ["play", "shop", "--split", "eval", "--set", "env.options.types=3"],
        input="\n".join(lines) + "\n",
    )
    assert result.exit_code == 0, result.output
    assert "[INVALID] reward -0.1" in result.output
    assert "Page 1 (Total results:" in result.output
    assert "no action 99" in result.output
    assert result.output.count("[valid] reward +0") == 2 and result.output.rstrip().endswith("quit")


def test_search_with_tags_to_a_wrong_answer_and_turn_limit():
    result = runner.invoke(
        app,
        ["play", "search", "--set", "env.max_turns=2"],
        input="<search>anything at all</search>\n<answer>nobody</answer>\n",
    )
    assert result.exit_code == 0, result.output
    assert "<information>" in result.output
    assert "episode over (ended): won False, outcome 0" in result.output
    result = runner.invoke(
        app, ["play", "search", "--set", "env.max_turns=2"], input="search: a\nsearch: b\n"
    )
    assert "episode over (truncated at the turn limit)" in result.output


def test_user_errors_are_one_line():
    result = runner.invoke(app, ["play", "household", "--set", "env.options.rooms=3"])
    assert result.exit_code == 2 and "unknown option 'rooms'" in result.output
    result = runner.invoke(app, ["play", "castle"])
    assert result.exit_code == 2 and "unknown environment 'castle'" in result.output
    result = runner.invoke(app, ["play", "household", "--split", "test"])
    assert result.exit_code == 2 and "unknown split 'test'" in result.output
