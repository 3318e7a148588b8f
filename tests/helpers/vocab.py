"""The vocabulary a tiny model's tokenizer holds."""

from __future__ import annotations

import json
from pathlib import Path


def tokenizer_vocab(model_dir: Path) -> dict[str, int]:
    return json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
