"""graft_cli/ parses, prints and sets exit codes (docs/design.md §2): no command takes a run's lock,
guards a recompute, touches a manifest or makes the initial policy itself -- it calls
``stages.loop.run_stage`` (or ``stages.loop.commands``), which does so for the loop and the commands
alike. Read from every module's AST: imports, names and attributes."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO

# modules and names that are a run's bookkeeping, each with what it is
RUN_LOGIC_MODULES = {
    "schemas.lock": "the run's lock",
    "schemas.manifest": "manifests",
    "schemas.initial_model": "the initial policy's record",
    "stages.warmstart.initial": "making the initial policy",
}
RUN_LOGIC_NAMES = {
    "run_lock": "the run's lock",
    "guard_recompute": "the recompute guard",
    "check_recompute_inputs": "the recompute guard",
    "forget_rewritten": "manifests",
    "verify_finished": "manifests",
    "write_recorded_table": "manifests",
    "finish_iteration": "manifests",
    "record_file": "manifests",
    "record_overrides": "the stage's record",
    "ensure_initial_model": "making the initial policy",
    "acting_policy": "the initial policy",
    "record_initial_models": "the initial policy's record",
    "remove_stale_temporaries": "a run's leftovers",
    "start_snapshot": "a refused start",
    "discard_refused_start": "a refused start",
}


def run_logic(folder: Path) -> list[str]:
    """``file:line: what`` for every import of a run-logic module and every use of a run-logic name
    (as a name, an attribute or an imported alias) in the .py files under ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        where = path.relative_to(folder.parent)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            modules, names = [], []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            for module in modules:
                if module in RUN_LOGIC_MODULES:
                    found.append(f"{where}:{node.lineno}: imports {module} ({RUN_LOGIC_MODULES[module]})")
            for name in names:
                if name in RUN_LOGIC_NAMES:
                    found.append(f"{where}:{node.lineno}: uses {name} ({RUN_LOGIC_NAMES[name]})")
    return found


def test_graft_cli_holds_no_run_logic() -> None:
    assert run_logic(REPO / "graft_cli") == []


def test_the_check_finds_planted_run_logic(tmp_path: Path) -> None:
    cli = tmp_path / "graft_cli"
    cli.mkdir()
    (cli / "ok.py").write_text("from stages.loop import run_stage\nrun_stage(1, 'graph', 0, None)\n")
    (cli / "lock.py").write_text(
        "def f(run):\n    from schemas.lock import run_lock\n    with run_lock(run.root):\n        pass\n"
    )
    (cli / "prepare.py").write_text(
        "import stages.warmstart.initial as initial\ninitial.ensure_initial_model(1, 2)\n"
    )
    (cli / "guard.py").write_text(
        "from schemas import recompute\nrecompute.guard_recompute(1, 'graph', 0, False)\n"
    )
    assert run_logic(cli) == [
        "graft_cli/guard.py:2: uses guard_recompute (the recompute guard)",
        "graft_cli/lock.py:2: imports schemas.lock (the run's lock)",
        "graft_cli/lock.py:2: uses run_lock (the run's lock)",
        "graft_cli/lock.py:3: uses run_lock (the run's lock)",
        "graft_cli/prepare.py:1: imports stages.warmstart.initial (making the initial policy)",
        "graft_cli/prepare.py:2: uses ensure_initial_model (making the initial policy)",
    ]
