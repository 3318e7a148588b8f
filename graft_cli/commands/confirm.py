"""Asking before a stage command's --force removes later iterations or recomputes what it cannot
reproduce (``--yes`` answers for the user), and what a stage command hands ``run_stage``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # schemas.rundir and stages load when a command runs, not for --help
    from pathlib import Path

    from schemas.rundir import Run
    from stages.loop import StageCommand

YES_OPTION = typer.Option(
    False,
    "--yes",
    "-y",
    help="With --force: remove later iterations, and recompute what cannot be reproduced, without asking.",
)


def removal_confirmer(yes: bool) -> Callable[[str], bool]:
    """``confirm(statement)`` for schemas.recompute.guard_recompute: True with --yes; a prompt on a
    terminal; otherwise (a script, CI) False, so nothing is removed without an explicit --yes (the
    refusal then names the statement in one line)."""

    def confirm(statement: str) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty():
            return False
        return typer.confirm(f"{statement}. Continue?", default=False)

    return confirm


def stage_command(force: bool, yes: bool, overrides: list[str]) -> StageCommand:
    """What a stage command adds to ``run_stage``: ``--force``, its confirmation and ``--set``."""
    from stages.loop import StageCommand

    return StageCommand(force=force, confirm=removal_confirmer(yes), overrides=tuple(overrides))


def print_removed(run: Run, iteration: int, removed: list[Path]) -> None:
    """``removed what was computed from it: ...`` when ``--force`` removed anything."""
    from schemas.recompute import removed_summary

    if removed:
        typer.echo(removed_summary(run, iteration, removed))
