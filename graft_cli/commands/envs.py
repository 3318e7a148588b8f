"""Environment commands: ``graft play`` (a person plays any environment in the terminal)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from schemas.errors import GraftError

HELP = (
    "commands: a number (an admissible action), an action's text, 'expert' (take the scripted expert's "
    "next action), 'help', 'quit'"
)


def _read_line() -> str | None:
    line = sys.stdin.readline()
    return None if line == "" else line.strip()


def _to_action(style: str, text: str) -> str | None:
    """A typed line as the environment action (search: tags or 'search: q' / 'answer: a')."""
    from stages.envs.parser import parse_response

    if style == "search":
        if "<" in text:
            return parse_response("search", text)
        return text
    if "<action>" in text.lower():
        return parse_response(style, text)
    return " ".join(text.lower().split())


def play(
    env_name: str = typer.Argument(
        ..., metavar="ENV", help="Environment name (household, shop, search, ...)."
    ),
    task: int = typer.Option(0, "--task", help="Index of the task in the task set."),
    split: str = typer.Option("train", "--split", help="Task split: train | eval."),
    seed: int = typer.Option(0, "--seed", help="Task-set seed."),
    config: Path = typer.Option(None, "--config", help="Run config (TOML) whose [env] section to use."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Config override KEY=VALUE, e.g. --set env.options.receptacles=8 (repeatable)."
    ),
) -> None:
    """Play an environment in the terminal: read actions from stdin, show rewards and the outcome."""
    from schemas.config import check_seed

    check_seed(seed)
    from schemas.config import load_config
    from stages.envs.base import Episode, environment_tasks
    from stages.envs.registry import make_env

    if task < 0:
        raise GraftError(f"--task must be >= 0, got {task}")
    cfg = load_config(config, [f"env.name={env_name}", *overrides])
    kwargs = {"data": cfg.env.data, **cfg.env.options}
    explicit = {o.split("=", 1)[0].strip() for o in overrides}
    if config is not None or "env.max_turns" in explicit:  # else the environment's own default
        kwargs["max_turns"] = cfg.env.max_turns
    if config is not None or "env.invalid_penalty" in explicit:
        kwargs["invalid_penalty"] = cfg.env.invalid_penalty
    env = make_env(cfg.env.name, **kwargs)
    the_task = environment_tasks(env, split, task + 1, seed)[task]
    episode = Episode(env, the_task)
    echo = typer.echo
    echo(f"{env.name} task {task} ({split}, seed {seed}): {the_task.task_id} [{the_task.task_type}]")
    echo(f"Task: {episode.current.task_text}")
    echo(HELP)
    while not episode.done:
        current = episode.current
        echo(f"\n--- turn {episode.turn + 1}/{env.max_turns} ---\n{current.text}")
        for number, action in enumerate(current.admissible, 1):
            echo(f"  {number}. {action}")
        echo("> ", nl=False)
        line = _read_line()
        if line is None or line.lower() in ("quit", "q", "exit"):
            echo("\nquit")
            return
        if not line or line.lower() == "help":
            echo(HELP)
            continue
        if line.lower() == "expert":
            action = episode.game.expert_action()
            if action is None:
                echo("the expert has no action here")
                continue
            echo(f"expert: {action}")
        elif line.isdigit():
            number = int(line)
            if not 1 <= number <= len(current.admissible):
                echo(f"no action {number}; choose 1..{len(current.admissible)}")
                continue
            action = current.admissible[number - 1]
        else:
            action = _to_action(env.prompt_style, line)
        record = episode.act(action)
        status = "valid" if record.valid else "INVALID"
        echo(
            f"[{status}] reward {record.reward:+g}  done {record.done}  won {episode.won}  score {episode.score:g}"
        )
        if record.error:
            echo(f"environment error: {record.error}")
    echo(f"\n{episode.current.text}")
    if episode.error:
        ending = "environment error"
    elif record.truncated:
        ending = "truncated at the turn limit"
    else:
        ending = "won" if episode.won else "ended"
    echo(
        f"episode over ({ending}): won {episode.won}, outcome {episode.outcome:g}, "
        f"score {episode.score:g}, turns {episode.turn}"
    )


def register(app: typer.Typer) -> None:
    """Add this module's commands to the graft app."""
    app.command("play")(play)
