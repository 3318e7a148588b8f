"""Reading and writing graft tables: schema stamping, checking, atomic writes, checksums.

Checksums: every data and dictionary page of a table graft writes carries Parquet's own CRC-32
(``write_page_checksum``), and the stamp says so (``graft.checksum = parquet-page-crc32``); reading a
file with that stamp verifies every page, so a flipped bit in the data is an error naming the file,
never silently different numbers. (A checksum of the whole file cannot live inside the file, and a
sidecar would need a second atomic rename per table; the footer is covered by its Thrift parse and
the stamp and schema checks.) Costs about nothing: CRC-32 of the compressed pages.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.definitions import STEPS, STEPS_DEFAULTS, STEPS_OPTIONAL, TABLES, TableSpec
from schemas.errors import GraftError


def _spec(table: str) -> TableSpec:
    try:
        return TABLES[table]
    except KeyError:
        raise GraftError(f"unknown table '{table}'; tables: {', '.join(TABLES)}") from None


def conform(data: pl.DataFrame | pa.Table, table: str, source: str = "<memory>") -> pa.Table:
    """Return ``data`` as an Arrow table with exactly the columns and types of ``table``.

    Missing optional steps columns are filled with nulls; extra columns are dropped; types are cast
    safely (int64 -> int32 only when in range, large_string -> string). Anything else is a
    GraftError naming ``source``.
    """
    spec = _spec(table)
    arrow = data.to_arrow() if isinstance(data, pl.DataFrame) else data
    if table == "steps":
        arrow = _fill_step_defaults(arrow)
    missing = [c for c in spec.column_names if c not in arrow.column_names]
    optional = STEPS_OPTIONAL if table == "steps" else ("split",) if table == "eval" else ()
    required_missing = [c for c in missing if c not in optional]
    if required_missing:
        raise GraftError(f"{source}: {table} table is missing column(s) {', '.join(required_missing)}")
    arrays = []
    for col in spec.columns:
        if col.name in missing:
            arrays.append(pa.nulls(arrow.num_rows, col.type))
            continue
        column = arrow.column(col.name)
        if not column.type.equals(col.type):
            try:
                column = column.cast(col.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise GraftError(
                    f"{source}: column '{col.name}' has type {column.type}, expected {col.type}"
                ) from None
        if not col.nullable and column.null_count:
            raise GraftError(f"{source}: column '{col.name}' has {column.null_count} null value(s)")
        arrays.append(column)
    return pa.Table.from_arrays(arrays, schema=spec.schema)


def _fill_step_defaults(arrow: pa.Table) -> pa.Table:
    """Add the steps columns an external table may omit (STEPS_DEFAULTS): iter 0, task_id = group_id,
    task_type "", observation = state, valid true. Needs the columns they copy; otherwise left missing
    (the caller then names them)."""
    n = arrow.num_rows
    for name, fill in STEPS_DEFAULTS.items():
        if name in arrow.column_names:
            continue
        if fill in arrow.column_names:
            column = arrow.column(fill)
        elif fill in ("group_id", "state"):
            continue
        else:
            value = {"0": 0, '""': "", "true": True}[fill]
            column = pa.array([value] * n, type=STEPS.column(name).type)
        arrow = arrow.append_column(name, column)
    return arrow


def publish_mode(path: str | Path, directory: bool = False) -> None:
    """Give a temporary file (0600 from mkstemp) or directory (0700) the ordinary umask permissions
    before it is renamed into place, so finished outputs are readable like any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


CHECKSUM_KEY = b"graft.checksum"
PAGE_CRC = b"parquet-page-crc32"


def write_table(data: pl.DataFrame | pa.Table, table: str, path: str | Path) -> Path:
    """Write ``data`` as graft table ``table`` to ``path`` atomically (temporary name + rename).

    A crash mid-write leaves at most a ``.tmp`` file that no reader treats as the table.
    """
    path = Path(path)
    arrow = conform(data, table, source=str(path))
    stamped = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}), CHECKSUM_KEY: PAGE_CRC})
    write_in_folder(
        path, lambda fh: pq.write_table(stamped, fh, compression="zstd", write_page_checksum=True)
    )
    return path


_TEMP_LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile's: removers match 8 of them


def write_in_folder(path: Path, fill: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically: ``fill`` writes a temporary sibling ``.<name>.<8 letters>.tmp``
    (created exclusively, never through a link), which is synced and renamed into place.

    Inside a run this process holds the lock of, the folder is opened from the run's root without
    following a link (schemas.confine.open_run_folder: a link on the way is a GraftError), and the
    file is created and renamed relative to that open folder, so a link swapped in meanwhile leads
    nowhere. Elsewhere (an output folder the user named) it works by path as before."""
    import secrets

    from schemas.confine import open_run_folder

    folder_fd = open_run_folder(path.parent, create=True)
    if folder_fd is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        folder_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(100):
            name = f".{path.name}.{''.join(secrets.choice(_TEMP_LETTERS) for _ in range(8))}.tmp"
            try:
                fd = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder_fd
                )
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")
        try:
            with os.fdopen(fd, "wb") as fh:
                fill(fh)
                fh.flush()
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(fh.fileno(), 0o666 & ~umask)  # publish_mode's permissions, on the open file
                os.fsync(fh.fileno())
            os.replace(name, path.name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder_fd)
            raise
    finally:
        os.close(folder_fd)


def read_table(path: str | Path, table: str, *, require_stamp: bool = True) -> pl.DataFrame:
    """Read graft table ``table`` from ``path``, checking name, version, columns and types.

    ``require_stamp=False`` accepts Parquet files written by other tools (external rollouts) that
    carry no ``graft.table`` metadata; their columns and types are still checked.
    """
    path = Path(path)
    spec = _spec(table)
    if not path.is_file():
        raise GraftError(f"{path}: file not found (expected the {table} table)")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise GraftError(f"{path}: not a readable Parquet file ({exc})") from None
    meta = schema.metadata or {}
    name = meta.get(b"graft.table")
    version = meta.get(b"graft.schema_version")
    if name is None:
        if require_stamp:
            raise GraftError(f"{path}: no graft.table metadata (not written by graft); expected '{table}'")
    else:
        if name.decode(errors="replace") != table:
            raise GraftError(f"{path}: holds the '{name.decode(errors='replace')}' table, expected '{table}'")
        number = _stamp_version(version)
        if number not in (spec.version, *spec.reads):
            if version is None:
                got = "none"
            else:  # a number as it is, anything else quoted
                got = str(number) if number is not None else repr(version.decode(errors="replace"))
            raise GraftError(f"{path}: {table} schema version {got}, this graft reads version {spec.version}")
    if meta.get(CHECKSUM_KEY) == PAGE_CRC:
        # graft's own tables carry page checksums, which only pyarrow's reader verifies
        return pl.from_arrow(conform(read_arrow(path), table, source=str(path)))  # type: ignore[return-value]
    names = set(schema.names)
    if all(c.name in names and schema.field(c.name).type.equals(c.type) for c in spec.columns):
        # Every column present with its exact type: polars' reader, ~2x faster than pyarrow's + a
        # conversion; only the null checks of conform remain. Anything else: conform.
        try:
            frame = pl.read_parquet(path, columns=spec.column_names)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise GraftError(f"{path}: damaged Parquet data ({str(exc).strip().splitlines()[0]})") from None
        for col in spec.columns:
            nulls = frame[col.name].null_count()
            if nulls and not col.nullable:
                raise GraftError(f"{path}: column '{col.name}' has {nulls} null value(s)")
        return frame
    arrow = read_arrow(path, verify=False)
    return pl.from_arrow(conform(arrow, table, source=str(path)))  # type: ignore[return-value]


def _stamp_version(raw: bytes | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def read_arrow(path: Path, verify: bool = True) -> pa.Table:
    """All of a Parquet file, verifying page checksums when ``verify``; damage is a GraftError."""
    try:
        return pq.read_table(path, page_checksum_verification=verify)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraftError(f"{path}: damaged Parquet data ({first})") from None


def verify_table(path: str | Path) -> str | None:
    """None when the graft table at ``path`` reads back intact, else what is wrong (one line)."""
    path = Path(path)
    try:
        meta = pq.read_schema(path).metadata or {}
        read_arrow(path, verify=meta.get(CHECKSUM_KEY) == PAGE_CRC)
    except GraftError as exc:
        return str(exc)
    except (pa.ArrowException, OSError) as exc:
        return f"{path}: not a readable Parquet file ({exc})"
    return None
