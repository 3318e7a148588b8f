"""Writing so that a name that exists is complete: a temporary sibling, then a rename into place
(files, directories), and removal in an order that never leaves half of a directory under its name."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from schemas.confine import open_run_folder, refuse_links_inside
from schemas.io import publish_mode, write_in_folder


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename; inside a run this process
    writes, every folder on the way is opened without following a link (schemas.confine)."""
    path = Path(path)

    def fill(fh) -> None:  # type: ignore[no-untyped-def]
        fh.write(text.encode())

    write_in_folder(path, fill)


def atomic_dir(final: Path) -> Path:
    """Return a fresh temporary sibling directory to fill, then ``commit_dir`` it to ``final`` (inside a
    run, the folders above it are no links: schemas.confine)."""
    fd = open_run_folder(final.parent, create=True)
    if fd is not None:
        os.close(fd)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    publish_mode(tmp, directory=True)
    return tmp


@contextmanager
def filled_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary sibling of ``final`` to fill inside the ``with`` block: committed to ``final``
    (``commit_dir``) when the block ends normally, removed when it raises -- never half a directory
    under the final name."""
    tmp = atomic_dir(final)
    try:
        yield tmp
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_dir(tmp: Path, final: Path) -> None:
    """Move a filled temporary directory into place (replacing an incomplete ``final``).

    Files inside get the ordinary umask permissions first: libraries write some through their own
    temporary files (transformers' ``model.safetensors`` arrives 0600), and a checkpoint should be
    readable like any other output."""
    for path in tmp.rglob("*"):
        if path.is_file() and not path.is_symlink():
            publish_mode(path)
    fd = open_run_folder(final.parent)
    if fd is None:
        if final.is_symlink():  # a link is replaced, never followed (schemas.confine refuses links out)
            final.unlink()
        elif final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return
    try:  # relative to the opened parent: a link swapped in above is not followed
        _refuse_link_entry(final, fd)
        _remove_entry(final.name, fd)
        os.replace(tmp.name, final.name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def _refuse_link_entry(path: Path, fd: int) -> None:
    """Inside a run this process writes, an output is never a link (schemas.confine): refused, not
    replaced."""
    import stat

    from schemas.confine import refuse_link_entries

    try:
        if stat.S_ISLNK(os.lstat(path.name, dir_fd=fd).st_mode):
            refuse_link_entries([path])
    except FileNotFoundError:
        pass


def _remove_entry(name: str, fd: int) -> None:
    """Remove ``name`` in the folder open as ``fd``: a folder (not a link) recursively, else the entry
    itself (a link is removed, never followed)."""
    import stat

    try:
        info = os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=fd)
    else:
        os.unlink(name, dir_fd=fd)


def remove_stale_temporaries(final: Path) -> list[Path]:
    """Remove the temporary siblings ``atomic_dir`` / ``atomic_write_text`` made for ``final``
    (``.<name>.<8 random characters>.tmp``) that a killed process left behind; returns them."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.[a-z0-9_]{{8}}\.tmp")
    removed = []
    refuse_links_inside(final)
    if not final.parent.is_dir():
        return removed
    for path in final.parent.iterdir():
        if not pattern.fullmatch(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def remove_outputs(paths: list[Path]) -> None:
    """Remove files and directories in the given order. A directory is first renamed to a temporary
    name (atomic; ``remove_stale_temporaries`` of the loop deletes leftovers), so a crash never leaves
    half of one looking complete. A symlink is removed itself, never what it points to."""
    for path in paths:
        fd = open_run_folder(path.parent) if path.parent.exists() or path.parent.is_symlink() else None
        if fd is None:
            if path.is_dir() and not path.is_symlink():
                tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
                os.replace(path, tmp)  # replaces the empty placeholder directory
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            continue
        try:  # relative to the opened parent: nothing is removed through a link
            if path.is_dir() and not path.is_symlink():
                tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
                os.replace(path.name, tmp.name, src_dir_fd=fd, dst_dir_fd=fd)
                shutil.rmtree(tmp.name, dir_fd=fd, ignore_errors=True)
            else:
                _refuse_link_entry(path, fd)
                _remove_entry(path.name, fd)
        finally:
            os.close(fd)
