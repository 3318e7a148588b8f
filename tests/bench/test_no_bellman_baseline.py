"""The graph baseline without Bellman values (``graphmc``: node value = mean return of the rollouts
through the node) runs in both benches that compare estimators: the learning bench (a variant, a
real loop iteration) and the estimator-accuracy bench (a credit row scored against the exact A^π)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.estimator_accuracy import measure
from bench.learning.runs import run_variant
from bench.learning.variants import VARIANTS
from schemas import read_table
from schemas.config import load_config
from schemas.rundir import open_run
from stages.credit.api import advantages
from tests.helpers.loop_runs import MICRO
from tests.helpers.paths import REPO

QUICKSTART = REPO / "configs" / "quickstart.toml"


def test_every_learning_variant_is_a_valid_config() -> None:
    # a misspelt override would only surface hours into a registered run
    for overrides in VARIANTS.values():
        load_config(QUICKSTART, overrides)
    assert load_config(QUICKSTART, VARIANTS["graphmc"]).advantage.estimator == "graphmc"


def test_the_learning_bench_runs_graphmc_through_the_loop(tmp_path: Path) -> None:
    micro = [s for s in MICRO if not s.startswith("run.iters=")]
    run_dir, _ = run_variant(QUICKSTART, tmp_path, "graphmc", 0, 1, micro, [])
    assert run_dir == tmp_path / "graphmc-s0"
    run = open_run(run_dir)
    config = load_config(run.config_path)
    assert config.advantage.estimator == "graphmc"
    steps = read_table(run.iter_dir(0) / "steps.parquet", "steps")
    stored = read_table(run.iter_dir(0) / "advantages.parquet", "advantages").sort("traj_id", "step")
    # the loop's advantages are graphmc's, recomputed here from the iteration's own steps
    again = advantages(steps, config=config).sort("traj_id", "step")
    np.testing.assert_allclose(stored["advantage"].to_numpy(), again["advantage"].to_numpy(), atol=1e-12)
    assert stored.height == steps.height > 0


def accuracy(merge: float) -> dict[tuple[str, str], float]:
    args = argparse.Namespace(groups=32, horizon=5, width=3, merge=merge, gamma=1.0)
    return measure(seed=0, group_size=8, args=args)


def test_the_accuracy_bench_scores_graphmc_against_the_exact_advantage() -> None:
    tree, merged = accuracy(0.0), accuracy(0.75)
    # with merge 0 every node is reached by one prefix: the visits' mean return IS the Bellman value
    # of the empirical graph, so graphmc's TD equals graft's row for row, up to rounding (equal MSE; ρ
    # moves in the 5th digit where rounding splits credits that are tied in exact arithmetic)
    assert abs(tree[("graphmc TD", "mse")] - tree[("graft TD", "mse")]) < 1e-12
    assert abs(tree[("graphmc TD", "rho")] - tree[("graft TD", "rho")]) < 1e-4
    # where trajectories merge, the Bellman solve pools the continuations and the two differ
    assert abs(merged[("graphmc TD", "mse")] - merged[("graft TD", "mse")]) > 1e-4
    for label in ("graphmc TD", "graphmc (node norm)"):
        assert np.isfinite(merged[(label, "rho")])
