"""What the CLI imports: ``graft --help`` stays light, the credit commands never load torch/transformers."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.credit_cases import fig2_steps
from tests.helpers.paths import REPO

HEAVY = ("torch", "transformers", "sentence_transformers")

_PROBE = """
import json, sys
from graft_cli.app import app
try:
    app(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if "." not in m)))
"""


def _modules_after(*args: str) -> set[str]:
    """Top-level modules loaded by one in-process ``graft ARGS`` call, in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, cwd=REPO, check=True
    )
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_help_imports_no_table_or_model_libraries():
    for args in (["--help"], ["advantage", "--help"]):
        loaded = _modules_after(*args)
        assert not loaded & {*HEAVY, "polars", "pyarrow", "numpy", "scipy"}, (args, loaded)


def test_credit_commands_import_neither_torch_nor_transformers(tmp_path):
    steps = tmp_path / "steps.parquet"
    fig2_steps().write_parquet(steps)
    out = tmp_path / "out"
    for args in (  # graph, solve and advantage in one process; then a baseline on the same tables
        ["advantage", str(steps), "-o", str(out)],
        ["advantage", str(steps), "-o", str(out), "--set", "advantage.estimator=gigpo"],
    ):
        loaded = _modules_after(*args)
        assert "polars" in loaded  # the command did run
        assert not loaded & set(HEAVY), (args, loaded & set(HEAVY))
    assert (out / "advantages.parquet").is_file()


def test_ray_is_loaded_only_by_the_ray_executor():
    """The default install and the quickstart need no ray (an optional extra): neither ``graft loop
    --help`` nor the loop's modules import it; only ``stages.cluster.ray_executor`` does."""
    assert "ray" not in _modules_after("loop", "--help")
    probe = "import sys, stages.loop, stages.cluster, stages.cluster.worker; print('ray' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert proc.stdout.strip() == "False"
