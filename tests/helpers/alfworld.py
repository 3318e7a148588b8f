"""The real ALFWorld data for tests: where it is, and skipping a test when the package or the data is
missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.paths import SHARED_DATA

DATA = Path(os.environ.get("ALFWORLD_DATA") or SHARED_DATA / "alfworld")


def needs_alfworld() -> None:
    pytest.importorskip("alfworld", reason="the alfworld package is not installed (pip install -e '.[envs]')")
    if not (DATA / "json_2.1.1").is_dir():
        pytest.skip(f"no ALFWorld data at {DATA} (set ALFWORLD_DATA)")
