"""Verify graft tables before a reader that does not check page CRCs (DuckDB) sees them.

``verify_tables(paths)`` reads each Parquet file once with pyarrow's page-checksum verification
(``schemas.io.verify_table``) and raises one GraftError naming the first damaged file. A file that
verified before is not read again while its identity is unchanged: (device, inode, size, mtime_ns,
ctime_ns), kept in ``$GRAFT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/graft`` or ``~/.cache/graft``)
as ``verified-tables.json``. Any write to a file changes its ctime (which no user call can set back),
so a changed file is always verified again; the cache only ever records files that verified.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from schemas.errors import GraftError
from schemas.io import verify_table
from schemas.jsonfile import load_json

CACHE_FILE = "verified-tables.json"
_MAX_ENTRIES = 100_000  # a bound on the cache file: the oldest entries go first


def cache_dir() -> Path:
    """Where the verification cache lives (``GRAFT_CACHE_DIR`` > ``XDG_CACHE_HOME/graft`` > ~/.cache/graft)."""
    explicit = os.environ.get("GRAFT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "graft"


RUN_CONTENTS = ("manifest.json", ".lock", "checkpoints", "model")


def _enclosing_run(folder: Path) -> Path | None:
    """The graft run ``folder`` lies in (the folder itself or an ancestor holding a run's config.toml
    with a run's files beside it), or None."""
    for candidate in [folder, *folder.parents]:
        if (candidate / "config.toml").is_file() and (
            any((candidate / name).exists() for name in RUN_CONTENTS) or any(candidate.glob("iter_[0-9]*"))
        ):
            return candidate
    return None


def checked_cache_dir() -> Path:
    """``cache_dir()``, refused (GraftError, one line) when it lies inside any graft run: the cache is
    graft's own, and nothing outside a run's own writers may write into a run (a cache file in a
    finished iteration's folder would make every reader of that run refuse it)."""
    cache = cache_dir()
    inside = _enclosing_run(cache.resolve())
    if inside is not None:
        raise GraftError(
            f"{cache}: graft's cache directory (GRAFT_CACHE_DIR, XDG_CACHE_HOME) is inside the run "
            f"{inside}; it must live outside every run (point GRAFT_CACHE_DIR elsewhere)"
        )
    return cache


def refuse_cache_inside(root: Path) -> None:
    """GraftError when the cache directory lies inside the run at ``root``: writing the cache there
    would add files to the run (a finished iteration's folder among them) that every later reader
    refuses."""
    cache, base = cache_dir().resolve(), Path(root).resolve()
    if cache == base or base in cache.parents:
        raise GraftError(
            f"{cache_dir()}: graft's cache directory (GRAFT_CACHE_DIR, XDG_CACHE_HOME) is inside the run "
            f"{root}; it must live outside every run (point GRAFT_CACHE_DIR elsewhere)"
        )


def file_identity(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _load(path: Path) -> dict[str, list[int]]:
    try:
        data = load_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(path: Path, entries: dict[str, list[int]]) -> None:
    """Best effort: a cache that cannot be written only costs a re-verification next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = dict(list(entries.items())[-_MAX_ENTRIES:])
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verified-", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(keep, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def known_intact(kind: str) -> tuple[Callable[..., bool], Callable[[], None]]:
    """(check, commit) for another check keyed the same way (``kind``, e.g. "manifest"): ``check(path,
    expected="")`` is True when ``path`` passed a ``kind`` check against ``expected`` (e.g. the checksum
    a manifest records) in its current state; after every file passed, ``commit()`` records the ones
    asked about (so a failed check records nothing)."""
    cache_path = checked_cache_dir() / CACHE_FILE
    cache = _load(cache_path)
    asked: dict[str, list[int]] = {}

    def check(path: Path, expected: str = "") -> bool:
        key = f"{kind}:{expected}:{Path(path).resolve()}" if expected else f"{kind}:{Path(path).resolve()}"
        identity = file_identity(Path(path))
        asked[key] = identity
        return cache.get(key) == identity

    def commit() -> None:
        fresh = {k: v for k, v in asked.items() if cache.get(k) != v}
        if fresh:
            for key in fresh:
                cache.pop(key, None)
            _save(cache_path, {**cache, **fresh})

    return check, commit


def verify_tables(paths: Iterable[Path]) -> int:
    """Verify every file of ``paths`` not verified before in its current state; return how many were read.

    Raises GraftError (the file and what is wrong, one line) at the first damaged file.
    """
    cache_path = checked_cache_dir() / CACHE_FILE
    cache = _load(cache_path)
    read = 0
    changed = False
    for path in paths:
        key = str(Path(path).resolve())
        identity = file_identity(Path(path))
        if cache.get(key) == identity:
            continue
        problem = verify_table(path)
        read += 1
        if problem is not None:
            if cache.pop(key, None) is not None:
                _save(cache_path, cache)
            raise GraftError(f"{problem}; graft sql serves no damaged table")
        cache.pop(key, None)
        cache[key] = identity  # newest last: the bound drops the oldest
        changed = True
    if changed:
        _save(cache_path, cache)
    return read
