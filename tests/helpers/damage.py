"""Damage planted into a written table: where its column data lies, and a flipped bit there."""

from __future__ import annotations

from pathlib import Path


def data_region(path: Path) -> tuple[int, int]:
    """Byte range of the column data: after the magic, before the first byte of the footer."""
    size = path.stat().st_size
    footer = int.from_bytes(path.read_bytes()[-8:-4], "little")
    return 4, size - 8 - footer


def flip_bit(path: Path, position: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 1 << bit
    path.write_bytes(bytes(data))
