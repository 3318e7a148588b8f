"""No absolute path of the machine that wrote a file stands in the repository: records, docs, configs
and code write ``<worktree>``, ``runs/...`` or a path relative to the checkout instead, so they read the
same on every machine (a home folder, a worktree or run folder, a temporary directory of a test)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.paths import REPO

# a home or work folder, a root home, a tempfile or pytest directory; not preceded by a word, a dot
# or a slash (so URLs and relative paths do not count)
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work/|root/|home/\w|Users/\w|tmp/tmp\w|tmp/pytest-of-)")
TOP = ("README.md", "BENCHMARKS.md", "pyproject.toml", ".gitignore")
FOLDERS = (
    ".ci",
    "bench",
    "configs",
    "data",
    "docs",
    "examples",
    "graft_cli",
    "schemas",
    "stages",
    "tests",
    "tools",
)
TEXT = {".py", ".md", ".toml", ".json", ".jsonl", ".sh", ".txt", ".cfg", ".yaml", ".yml", ""}


def text_files(root: Path) -> list[Path]:
    """The repository's text files: the top-level documents and every text file of its folders."""
    found = [root / name for name in TOP if (root / name).is_file()]
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and path.suffix in TEXT and "__pycache__" not in path.parts:
                found.append(path)
    return found


def machine_paths(root: Path = REPO) -> list[str]:
    """``file:line: path`` for every absolute machine path in the repository's text files."""
    found = []
    for path in text_files(root):
        if path == Path(__file__):
            continue  # its own pattern and planted paths
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in MACHINE_PATH.finditer(line):
                rest = line[match.start() :].split()[0].strip("`'\",;:)(")
                found.append(f"{path.relative_to(root).as_posix()}:{number}: {rest}")
    return found


def test_no_absolute_machine_path_in_the_repository() -> None:
    assert machine_paths() == []


def test_the_check_sees_a_planted_machine_path(tmp_path: Path) -> None:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "stages").mkdir()
    (tmp_path / "docs" / "results" / "x.md").write_text(
        "Runs under `/wor" + "k/bench_runs/x/s0` and runs/x/s1.\nSee https://example.org/root/page.\n"
    )
    (tmp_path / "stages" / "y.py").write_text('DATA = "/ro' + 'ot/data"\nTMP = "/tm' + 'p/tmpab12/file"\n')
    (tmp_path / "README.md").write_text("Relative: ../shared/data and <worktree>/runs.\n")
    assert machine_paths(tmp_path) == [
        "docs/results/x.md:1: /work/bench_runs/x/s0",
        "stages/y.py:1: /root/data",
        "stages/y.py:2: /tmp/tmpab12/file",
    ]
