"""Regenerate ``docs/quickstart`` (curves, report, provenance) from a finished quickstart run.

    graft loop --config configs/quickstart.toml          # writes runs/quickstart
    python bench/quickstart_docs.py [runs/quickstart]

``docs/quickstart/provenance.json`` records what the pictures and the README's quickstart lines come
from: the sha256 of the resolved config (every key, defaults included, as ``config.toml`` saves it),
the commit, and the numbers the README quotes. tests/test_quickstart_docs.py fails when the config
or a default it resolves to changes without the docs being regenerated, and when the README quotes
other numbers than the provenance holds.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schemas.config import load_config  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart.toml"
DOCS = ROOT / "docs" / "quickstart"


def config_digest(path: Path = CONFIG) -> str:
    """sha256 of the resolved config's TOML: every setting that changes what the run computes
    (``run.iters`` included: the docs show that many), defaults included; not the bookkeeping
    sections (``[checkpoint]``, ``[log]``, ``[cluster]``), nor ``[sft]`` while the warm start is off."""
    from schemas.config import dump_toml

    data = load_config(path).to_dict()
    for section in ("checkpoint", "log", "cluster"):
        data.pop(section)
    if not data["sft"]["enabled"]:
        data["sft"] = {"enabled": False}
    return hashlib.sha256(dump_toml(data).encode()).hexdigest()


def run_numbers(run_dir: Path) -> dict[str, float]:
    import polars as pl

    from schemas.rundir import open_run
    from stages.report import load_run_tables, training_curve

    tables = load_run_tables(open_run(run_dir))
    curve = training_curve(tables.metrics, "success_rate")["value"].to_list()
    ev = tables.eval.filter((pl.col("name") == "success_rate") & pl.col("task_type").is_null()).sort("x")
    return {
        "iterations": len(curve),
        "training_success_first": round(curve[0], 3),
        "training_success_last": round(curve[-1], 3),
        "training_success_best": round(max(curve), 3),
        "eval_success_initial": round(float(ev["value"][0]), 3),
        "eval_success_last": round(float(ev["value"][-1]), 3),
    }


def main() -> None:
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "runs" / "quickstart"
    subprocess.run(["graft", "report", str(run_dir), "-o", str(DOCS)], check=True, cwd=ROOT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    provenance = {
        "config": "configs/quickstart.toml",
        "config_sha256": config_digest(),
        "commit": commit.stdout.strip(),
        **run_numbers(run_dir),
    }
    (DOCS / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance, indent=2))


if __name__ == "__main__":
    main()
