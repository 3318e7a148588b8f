"""A stdout closed by its reader (``graft ... | head -1``) ends every command quietly with status 141
(128 + SIGPIPE, as ``yes | head -1``): no traceback, no "Exception ignored", and no blaming of a
plug-in for the ``sys.exit(1)`` rich's console makes on a broken pipe. Each command writes into a pipe
whose reading end is closed before it starts, so the first write fails (deterministic, unlike head)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO


def _into_closed_pipe(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        return subprocess.run(
            [sys.executable, "-m", "graft_cli", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=cwd,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    done = subprocess.run(
        [sys.executable, "-m", "graft_cli", "synth", str(out), "--groups", "4"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    return out


COMMANDS = {
    "schema": ["schema", "steps"],
    "help": ["--help"],
    "command help": ["sql", "--help"],
    "version": ["--version"],
    "play": ["play", "household", "--task", "3"],
}


@pytest.mark.parametrize("label", sorted(COMMANDS))
def test_a_closed_stdout_ends_a_command_quietly(label: str) -> None:
    done = _into_closed_pipe(COMMANDS[label])
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert done.stderr == "", done.stderr  # was: "called sys.exit(1) inside graft ... plug-in"


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_sql_into_a_closed_stdout_is_quiet_in_every_format(tables: Path, fmt: str) -> None:
    done = _into_closed_pipe(["sql", str(tables), "SELECT * FROM steps", "--format", fmt])
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert done.stderr == "", done.stderr


def test_an_error_into_a_closed_stdout_keeps_its_line_and_status(tmp_path: Path) -> None:
    done = _into_closed_pipe(["sql", str(tmp_path / "absent"), "SELECT 1"])
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "run directory not found" in done.stderr


def _with_stdout_closed(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``graft ARGS >&-``: the process starts without a descriptor 1 (Python's sys.stdout is None)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "graft_cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
        preexec_fn=lambda: os.close(1),
    )


@pytest.mark.parametrize(
    "args",
    [["--version"], ["schema", "steps"], ["sql", "absent", "SELECT 1"], ["synth", "out"], ["loop"]],
)
def test_a_command_started_with_stdout_closed_says_so_in_one_line(args: list[str], tmp_path: Path) -> None:
    done = _with_stdout_closed(args, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Bad file descriptor" in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # refused before the command ran: synth wrote nothing
