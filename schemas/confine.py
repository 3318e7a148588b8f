"""A run is one folder: nothing graft reads or writes through it may lie outside it.

A symlink inside a run (an iteration, a checkpoint, the initial model, a table) that resolves outside
the run would make a writer remove or write files elsewhere (``--force`` deleting another folder's
tables) and a reader serve them. ``links_out_of(root)`` finds every such link; ``refuse_links_out``
is the one rule every command applies before it touches a run: the run lock (every writer takes it
first), ``graft sql`` and ``graft export``. Symlinks that stay inside the run are allowed.

Kept free of polars (like schemas.lock, which calls it) so that taking a lock stays cheap.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from schemas.errors import GraftError


def links_out_of(root: Path) -> Iterator[tuple[Path, Path]]:
    """Every symlink under ``root`` (none is followed) whose target resolves outside ``root``, with
    that target; a symlink loop is a GraftError (it leads nowhere)."""
    base = Path(root).resolve()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if not path.is_symlink():
                continue
            try:
                target = path.resolve(strict=False)
            except (RuntimeError, OSError):
                raise GraftError(f"{path}: a symlink loop in the run; graft refuses it") from None
            if target != base and base not in target.parents:
                yield path, target


def refuse_links_out(root: str | Path, who: str = "graft writes") -> None:
    """GraftError (one line) when the run at ``root`` holds a symlink that resolves outside it:
    ``<link>: symlink to <target>, outside the run; <who> nothing outside it`` (``who``: e.g.
    "graft sql reads").
    Called before anything in the run is removed or written (and before a reader serves it)."""
    if not Path(root).is_dir():
        return  # a new run: nothing there yet
    for link, target in links_out_of(Path(root)):
        raise GraftError(
            f"{link}: symlink to {target}, outside the run; {who} nothing outside it "
            "(replace the link with the folder or file itself)"
        )


# ---------------------------------------------------------------------------------------------
# no link inside a run is written through: checked where each file or folder is opened or created

_WRITTEN_RUNS: dict[str, int] = {}  # absolute (unresolved) roots of the runs this process holds the lock of


def hold_run(root: str | Path) -> None:
    """Register ``root`` as a run this process writes (the run lock calls it, and ``release_run``)."""
    for key in {os.path.abspath(root), os.path.realpath(root)}:  # as given, and as the links above lead
        _WRITTEN_RUNS[key] = _WRITTEN_RUNS.get(key, 0) + 1


def release_run(root: str | Path) -> None:
    for key in {os.path.abspath(root), os.path.realpath(root)}:
        if _WRITTEN_RUNS.get(key, 0) <= 1:
            _WRITTEN_RUNS.pop(key, None)
        else:
            _WRITTEN_RUNS[key] -= 1


def written_run_of(path: str | Path) -> Path | None:
    """The root of the held run ``path`` lies in, lexically (links are not resolved: a link inside the
    run must not lead the path out of the check); None outside every run this process writes."""
    absolute = os.path.abspath(path)
    best = None
    for root in _WRITTEN_RUNS:
        if (absolute == root or absolute.startswith(root.rstrip(os.sep) + os.sep)) and (
            best is None or len(root) > len(best)
        ):
            best = root
    return Path(best) if best is not None else None


def _refuse_link(link: Path) -> GraftError:
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    return GraftError(
        f"{link}: a symlink (to {target}) inside the run; graft creates, enters and removes nothing "
        "through a link in a run (replace the link with the folder or file itself)"
    )


def open_run_folder(folder: str | Path, create: bool = False) -> int | None:
    """A file descriptor of ``folder`` reached from its run's root one component at a time, none of
    them followed when it is a symlink (``O_NOFOLLOW``; a link is a GraftError naming it); with
    ``create`` missing folders are made on the way (``mkdir`` relative to the open parent). None when
    ``folder`` lies in no run this process holds the lock of (the caller works by path). The caller
    closes the descriptor and opens, creates, renames and removes relative to it (``dir_fd``), so a
    link swapped in after this call is not followed either."""
    root = written_run_of(folder)
    if root is None:
        return None
    parts = Path(os.path.abspath(folder)).relative_to(root).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    here = root
    try:
        for part in parts:
            here = here / part
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # another writer of the run made it (a shard)
                    os.mkdir(part, dir_fd=fd)
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                if os.path.islink(here):
                    raise _refuse_link(here) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_links_inside(path: str | Path) -> None:
    """GraftError when a folder between ``path``'s run root and ``path`` (its parent and above) is a
    symlink; nothing for a path outside every run this process writes. For writers that must work by
    path (a library writes the folder's files): checked right before they do. A missing folder has
    no link to refuse."""
    try:
        fd = open_run_folder(Path(path).parent)
    except (FileNotFoundError, NotADirectoryError):
        return
    if fd is not None:
        os.close(fd)


def refuse_link_entries(paths: list[Path]) -> None:
    """GraftError naming the first of ``paths`` (outputs a writer is about to remove or replace) that is
    a symlink, or lies below one inside its run: checked before the first of them is removed."""
    for path in paths:
        refuse_links_inside(path)
        if Path(path).is_symlink() and written_run_of(path) is not None:
            raise _refuse_link(Path(path))
