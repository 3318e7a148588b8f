"""The run lock: one writer of a run directory at a time."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from schemas.confine import hold_run, refuse_links_out, release_run
from schemas.errors import GraftError

LOCK_FILE = ".lock"
# locks this process holds: resolved run root -> (open lock file, nesting depth, shared)
_HELD: dict[Path, tuple[IO[str], int, bool]] = {}


@contextmanager
def run_lock(root: str | Path, *, shared: bool = False) -> Iterator[None]:
    """Hold the run's lock while writing into it (``graft loop`` and every stage command take it).

    An ``flock`` on ``<run>/.lock``, taken before anything else in the run is touched (the lock file
    is the one thing created first). Exclusive by default; ``shared`` for writers of disjoint files
    that may run side by side (``graft rollout --shard``), which still exclude an exclusive holder.
    The kernel drops the lock when the process dies, so a killed loop leaves no stale lock. Nested
    use in one process is free (the outer hold covers it); another process is refused at once.

    A run holding a symlink that resolves outside it is refused before the lock is taken
    (schemas.confine): no writer removes or writes anything outside the run through it.
    """
    path = Path(root)
    key = path.resolve()
    held = _HELD.get(key)
    if held is not None:
        fh, depth, was_shared = held
        if was_shared and not shared:
            raise GraftError(
                f"{path}: this process holds a shared lock on the run and needs an exclusive one"
            )
        _HELD[key] = (fh, depth + 1, was_shared)
        try:
            yield
        finally:
            fh, depth, was_shared = _HELD[key]
            _HELD[key] = (fh, depth - 1, was_shared)
        return
    refuse_links_out(path)  # before the lock file: nothing in the run is touched through a link out
    path.mkdir(parents=True, exist_ok=True)
    fh = open(path / LOCK_FILE, "a")  # noqa: SIM115 - held until the block ends
    try:
        try:
            fcntl.flock(fh, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GraftError(
                f"{path}: another graft process is writing this run (it holds {path / LOCK_FILE}); "
                "wait for it to finish"
            ) from None
        _HELD[key] = (fh, 1, shared)
        hold_run(path)  # from now on every write into the run is checked for links (schemas.confine)
        try:
            yield
        finally:
            release_run(path)
            del _HELD[key]
    finally:
        fh.close()
