"""The learning benchmark's held-out table (bench/learning_bench.py): means over seeds with their
standard errors, hand-computed from hand-built eval tables."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from learning_bench import eval_table  # noqa: E402

from schemas import write_table  # noqa: E402
from schemas.config import Config  # noqa: E402
from schemas.rundir import create_run  # noqa: E402
from stages.evaluate import eval_rows, output_path  # noqa: E402


def one_turn_episodes(wins: int, episodes: int) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "traj_id": [f"t{i}" for i in range(episodes)],
            "task_type": ["pick"] * episodes,
            "step": [0] * episodes,
            "reward": [0.0] * episodes,
            "outcome": [10.0 if i < wins else 0.0 for i in range(episodes)],
        }
    )


def run_with_evals(root: Path, initial_wins: int, last_wins: int, episodes: int = 64) -> Path:
    """A run whose initial policy won ``initial_wins`` and whose checkpoint of iteration 1 (after 2
    updates) won ``last_wins`` of ``episodes`` held-out episodes."""
    run = create_run(root, Config())
    for iteration, wins in ((-1, initial_wins), (1, last_wins)):
        if iteration >= 0:
            run.iter_dir(iteration).mkdir(parents=True, exist_ok=True)
        rows = eval_rows(one_turn_episodes(wins, episodes), 10.0, iteration, f"ck{iteration}")
        write_table(rows, "eval", output_path(run, iteration))
    return run.root


def cells(table: str) -> list[str]:
    return [c.strip() for c in table.splitlines()[2].split("|")[1:-1]]


def test_held_out_table_gives_means_over_seeds_with_their_standard_errors(tmp_path: Path) -> None:
    a = run_with_evals(tmp_path / "a", 16, 32)  # 0.25 -> 0.50
    b = run_with_evals(tmp_path / "b", 16, 48)  # 0.25 -> 0.75
    row = cells(eval_table({"graft": [a, b]}))
    # last: mean 0.625, s.e. over the two seeds std([0.5, 0.75], ddof=1)/√2 = 0.125; paired change
    # 0.375 ± 0.125; one evaluation's own noise: √(mean(0.25/63, 0.1875/63)) = 0.0589
    assert row == ["graft", "64", "0.250 ± 0.000", "0.625 ± 0.125 (2)", "+0.375 ± 0.125", "0.059"]


def test_held_out_table_of_one_seed_uses_the_binomial_standard_error(tmp_path: Path) -> None:
    a = run_with_evals(tmp_path / "a", 16, 32)
    row = cells(eval_table({"graft": [a]}))
    initial, last = (0.25 * 0.75 / 63) ** 0.5, (0.25 / 63) ** 0.5
    assert row[2] == f"0.250 ± {initial:.3f}" and row[3] == f"0.500 ± {last:.3f} (2)"
    assert row[4] == f"+0.250 ± {(initial**2 + last**2) ** 0.5:.3f}"
    assert float(row[5]) == pytest.approx(last, abs=5e-4)
