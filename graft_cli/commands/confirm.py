"""Asking before a stage command's --force removes later iterations or recomputes what it cannot
reproduce (``--yes`` answers for the user)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

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
