"""The versioned table schemas: the one place every graft table is defined.

Public API::

    from schemas import TABLES, write_table, read_table, validate_steps
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.definitions import TABLES, ColumnSpec, TableSpec
    from schemas.io import conform, read_table, write_table
    from schemas.validate import validate_steps

# Loaded on first use (PEP 562), so ``from schemas.errors import GraftError`` -- all ``graft --help``
# needs -- does not import pyarrow and polars.
_HOME = {
    "TABLES": "schemas.definitions",
    "TableSpec": "schemas.definitions",
    "ColumnSpec": "schemas.definitions",
    "read_table": "schemas.io",
    "write_table": "schemas.io",
    "conform": "schemas.io",
    "validate_steps": "schemas.validate",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'schemas' has no attribute '{name}'")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "TABLES",
    "TableSpec",
    "ColumnSpec",
    "read_table",
    "write_table",
    "conform",
    "validate_steps",
]
