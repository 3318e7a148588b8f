"""Where things are, for a test in any folder: the repository and what lies beside it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
EXAMPLES = REPO / "examples"
SHARED_DATA = REPO.parent / "shared" / "data"  # data sets beside the checkout (../shared/data)
