"""Asking before a stage command's --force removes later iterations (``--yes`` answers for the user)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

YES_OPTION = typer.Option(False, "--yes", "-y", help="With --force: remove later iterations without asking.")


def removal_confirmer(yes: bool) -> Callable[[str], bool]:
    """``confirm(what)`` for schemas.rundir.guard_recompute: True with --yes; a prompt on a terminal;
    otherwise (a script, CI) False, so nothing is removed without an explicit --yes."""

    def confirm(what: str) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty():
            typer.echo(
                f"--force would remove {what}; pass --yes to confirm (no terminal to ask on)", err=True
            )
            return False
        return typer.confirm(f"--force removes {what}. Continue?", default=False)

    return confirm
