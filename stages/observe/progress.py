"""Progress bars on a terminal: count, elapsed time and ETA (rich); nothing at all off a terminal, so
logs and pipes get only the stages' own summary lines."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def terminal_progress(
    label: str, total: int | None, console: Any | None = None
) -> tuple[Callable[..., None], Callable[[], None]]:
    """(update(done, note="", total=None), close) of a transient bar; no-ops when stderr is not a
    terminal. ``total`` may be None when it is not known yet; an update can set it.

    ``console`` (a rich Console) overrides the stderr check, for tests and callers with their own.
    """
    if console is None:
        if not sys.stderr.isatty():
            return (lambda done, note="", total=None: None), (lambda: None)
        from rich.console import Console

        console = Console(stderr=True)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
        transient=True,
    )
    task = bar.add_task(label, total=total, note="")
    bar.start()

    def update(done: int, note: str = "", total: int | None = None) -> None:
        if total is not None:
            bar.update(task, total=total)
        bar.update(task, completed=done, note=note)

    return update, bar.stop
