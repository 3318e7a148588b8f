"""The three layers import one way: graft_cli (commands) → stages → schemas (docs/design.md).

Every import statement of every module is read from its AST — including imports inside functions,
which a runtime check would miss — and its target package compared with the importing layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what each layer may import from the project's own packages
ALLOWED = {
    "schemas": {"schemas"},
    "stages": {"schemas", "stages"},
    "graft_cli": {"schemas", "stages", "graft_cli"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative imports resolve to the file's
    own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join([*base, node.module or ""]).strip(".")))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def layer_violations(layer: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in ALLOWED and top not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_no_layer_imports_the_layer_above_it(layer: str) -> None:
    assert layer_violations(layer) == []


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    # the walk must find imports at any depth, absolute or relative
    source = "def f():\n    from graft_cli.app import app\n    from . import loop\n"
    module = ROOT / "stages" / "_probe_for_test.py"
    module.write_text(source)
    try:
        assert layer_violations("stages") == ["stages/_probe_for_test.py:2 imports graft_cli.app"]
        assert (3, "stages") in imported_modules(module)
    finally:
        module.unlink()


def test_graft_cli_holds_only_the_app_and_its_commands() -> None:
    files = {str(p.relative_to(ROOT / "graft_cli")) for p in (ROOT / "graft_cli").rglob("*.py")}
    assert {f for f in files if not f.startswith("commands/")} == {"__init__.py", "__main__.py", "app.py"}


def test_the_loop_names_its_stages_directly() -> None:
    source = (ROOT / "stages" / "loop" / "runner.py").read_text()
    assert "importlib" not in source and "KILL_AT" not in source and "os.kill" not in source
    from stages import credit, evaluate, rollout
    from stages.loop import STAGE_RUNNERS
    from stages.update import launch

    assert {
        "rollout": rollout.run_rollout,
        "graph": credit.run_graph,
        "solve": credit.run_solve,
        "advantage": credit.run_advantage,
        "update": launch.loop_update,  # run_update itself, or under torchrun (cluster.update_procs)
        "eval": evaluate.run_eval,
    } == STAGE_RUNNERS
