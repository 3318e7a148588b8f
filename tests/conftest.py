"""Shared fixtures: a small valid steps table, a CLI runner, a run directory with tables."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

# first: importing stages hides a torch extension built for another torch (stages/policy/torch_extensions.py)
# before any test module imports transformers
import stages  # noqa: F401, I001
from schemas.config import Config
from schemas.rundir import Run, create_run
from tests.helpers.paths import EXAMPLES


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """graft's user cache (schemas.verified) in a per-test directory, never the tester's ~/.cache."""
    monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path_factory.mktemp("graft-cache")))


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def small_steps() -> pl.DataFrame:
    """A valid steps table: 3 groups x 4 rollouts of random MDPs."""
    from stages.credit.synth import synth_steps

    steps = synth_steps(groups=3, group_size=4, horizon=6, seed=7)
    assert isinstance(steps, pl.DataFrame)
    return steps


@pytest.fixture
def examples_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/ on sys.path, so that the example plug-in (tests.helpers.examples) imports by name."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.fixture
def new_run(tmp_path: Path) -> Run:
    """An empty run directory pinned to the default config."""
    return create_run(tmp_path / "run", Config())
