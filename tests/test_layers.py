"""The house's import structure (docs/design.md), read from the code.

Three layers import one way: graft_cli (commands) → stages → schemas. Inside stages/, every package
directly under it is a room (credit/, rollout/, loop/, ...); rooms import each other without a circle,
so they stand on floors and no import runs back up. schemas and graft_cli are rooms of their own.

Every import statement of every module is read from its AST — including imports inside functions and
under ``TYPE_CHECKING``, which a runtime check would miss — and its target compared with the importing
file's layer and room.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO
# what each layer may import from the project's own packages
ALLOWED = {
    "schemas": {"schemas"},
    "stages": {"schemas", "stages"},
    "graft_cli": {"schemas", "stages", "graft_cli"},
}
# modules directly in stages/ beside its rooms: the package's face, and the README's import path of the
# synthetic rollouts (stages/credit/synth.py)
LOOSE_MODULES = {"__init__.py"}


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative imports resolve to the file's
    own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
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


# ---------------------------------------------------------------------------------------------
# rooms


def room_of(module: str, root: Path = ROOT) -> str | None:
    """The room a module of the project belongs to: ``schemas``, ``graft_cli``, ``stages.<package>`` or
    ``stages.<module>`` for a module directly in stages/; None for the ``stages`` package itself and for
    anything outside the project."""
    parts = module.split(".")
    if parts[0] in ("schemas", "graft_cli"):
        return parts[0]
    if parts[0] != "stages" or len(parts) < 2:
        return None
    return f"stages.{parts[1]}"


def import_targets(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``imported_modules`` with ``from package import name`` read as the module ``package.name`` where
    that is a module or package of the tree (``from stages import credit`` imports the credit room)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = imported_modules(path, root)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            folder = root.joinpath(*node.module.split("."))
            for alias in node.names:
                if (folder / alias.name).is_dir() or (folder / f"{alias.name}.py").is_file():
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    return found


def room_imports(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """room -> {room it imports: ["file:line imports module", ...]} over every module of the project."""
    graph: dict[str, dict[str, list[str]]] = {}
    for layer in ("schemas", "stages", "graft_cli"):
        for path in sorted((root / layer).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            room = room_of(module, root)
            if room is None:
                continue
            graph.setdefault(room, {})
            for line, target in import_targets(path, root):
                other = room_of(target, root)
                if other is not None and other != room:
                    where = f"{path.relative_to(root)}:{line} imports {target}"
                    graph[room].setdefault(other, []).append(where)
    return graph


def find_circle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """Rooms that import each other in a loop, first room repeated at the end; None when there is none."""
    state: dict[str, str] = {}  # "open" while on the path being walked, "done" after

    def walk(room: str, path: list[str]) -> list[str] | None:
        state[room] = "open"
        for other in sorted(graph.get(room, {})):
            if state.get(other) == "open":
                return path[path.index(other) :] + [other]
            if other not in state:
                circle = walk(other, [*path, other])
                if circle is not None:
                    return circle
        state[room] = "done"
        return None

    for room in sorted(graph):
        if room not in state:
            circle = walk(room, [room])
            if circle is not None:
                return circle
    return None


def describe_circle(graph: dict[str, dict[str, list[str]]], circle: list[str]) -> str:
    """Each step of ``circle`` with the first import that makes it."""
    return "; ".join(f"{a} -> {b} ({graph[a][b][0]})" for a, b in zip(circle, circle[1:], strict=False))


def test_rooms_import_each_other_without_a_circle() -> None:
    graph = room_imports()
    assert {"schemas", "graft_cli", "stages.credit", "stages.loop"} <= set(graph)
    circle = find_circle(graph)
    assert circle is None, describe_circle(graph, circle)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_a_planted_circle(tmp_path: Path) -> None:
    """Room a imports room b at module level; b imports a inside a function and through ``from stages
    import a``: both close a circle, which the checker names with the import that closes it."""
    base = {
        "schemas/__init__.py": "",
        "graft_cli/__init__.py": "from stages.b import y\n",
        "stages/__init__.py": "",
        "stages/a/__init__.py": "",
        "stages/a/x.py": "from schemas import TABLES\nfrom stages.b.y import f\n",
        "stages/b/__init__.py": "",
    }
    for closing in ("def f():\n    from stages.a import x\n", "from stages import a\n"):
        root = _tree(tmp_path / str(len(closing)), {**base, "stages/b/y.py": closing})
        graph = room_imports(root)
        assert set(graph["graft_cli"]) == {"stages.b"}  # a layer above: allowed, no circle
        circle = find_circle(graph)
        assert circle in (["stages.a", "stages.b", "stages.a"], ["stages.b", "stages.a", "stages.b"])
        assert "stages/b/y.py" in describe_circle(graph, circle)
    # without the closing import the same rooms stand on floors
    root = _tree(tmp_path / "open", {**base, "stages/b/y.py": "def f():\n    return 1\n"})
    assert find_circle(room_imports(root)) is None


def test_stages_holds_rooms_not_loose_modules() -> None:
    loose = {p.name for p in (ROOT / "stages").glob("*.py")}
    assert loose == LOOSE_MODULES
    for folder in (ROOT / "stages").iterdir():
        if folder.is_dir() and folder.name != "__pycache__":
            assert (folder / "__init__.py").is_file(), folder


def test_graft_cli_holds_only_the_app_and_its_commands() -> None:
    files = {str(p.relative_to(ROOT / "graft_cli")) for p in (ROOT / "graft_cli").rglob("*.py")}
    assert {f for f in files if not f.startswith("commands/")} == {"__init__.py", "__main__.py", "app.py"}


def test_the_loop_names_its_stages_directly() -> None:
    source = (ROOT / "stages" / "loop" / "runner.py").read_text()
    source += (ROOT / "stages" / "loop" / "stage.py").read_text()  # the table's home
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


# ---------------------------------------------------------------------------------------------
# stages never build a warm start

# what makes a run's initial policy (the tiny model, behaviour cloning, DAgger; the package's face
# hands ``ensure_initial_model`` on), and the only modules outside stages/warmstart/ that may call it:
# what prepares a run before a stage uses the policy (``run_stage``'s rule, ``graft sft``). A stage's
# runner acts with the policy ``acting_policy`` gives and builds nothing.
WARM_START_BUILDERS = (
    "stages.warmstart",
    "stages.warmstart.initial",
    "stages.warmstart.sft",
    "stages.warmstart.dagger",
)
PREPARERS = {"stages/loop/stage.py", "stages/loop/commands.py"}


def warm_start_builders_imported(root: Path = ROOT) -> list[str]:
    """``file:line imports module`` for every module of stages/ outside stages/warmstart/ and the
    preparers that imports what builds an initial policy."""
    found = []
    for path in sorted((root / "stages").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where.startswith("stages/warmstart/") or where in PREPARERS:
            continue
        for line, target in import_targets(path, root):
            if target in WARM_START_BUILDERS or target.startswith(
                tuple(f"{b}." for b in WARM_START_BUILDERS[1:])
            ):
                found.append(f"{where}:{line} imports {target}")
    return found


def test_stages_never_build_a_warm_start() -> None:
    assert warm_start_builders_imported() == []


def test_the_check_sees_a_stage_that_builds_a_warm_start(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "stages/__init__.py": "",
            "stages/warmstart/__init__.py": "from stages.warmstart.initial import ensure_initial_model\n",
            "stages/warmstart/initial.py": "from stages.warmstart.sft import run_sft\n",
            "stages/warmstart/sft.py": "",
            "stages/warmstart/demos.py": "",
            "stages/rollout/__init__.py": "",
            "stages/rollout/runner.py": "def run():\n    from stages.warmstart.initial import ensure_initial_model\n",
            "stages/update/runner.py": "from stages import warmstart\n",
            "stages/loop/preflight.py": "from stages.warmstart.demos import check_think\n",
            "stages/loop/stage.py": "from stages.warmstart import initial\n",
        },
    )
    assert warm_start_builders_imported(root) == [
        "stages/rollout/runner.py:2 imports stages.warmstart.initial",
        "stages/update/runner.py:1 imports stages.warmstart",
    ]
