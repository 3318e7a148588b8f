"""The learning benchmark's held-out table (bench/learning/): means over seeds with their
standard errors, hand-computed from hand-built eval tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from bench.learning.stats import paired_differences, paired_verdict
from bench.learning.tables import eval_table, success_table
from schemas import write_table
from schemas.config import Config
from schemas.manifest import write_manifest, write_recorded_table
from schemas.rundir import create_run, open_run
from stages.evaluate import eval_rows, output_path
from tests.helpers.paths import REPO

ROOT = REPO


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
        write_recorded_table(run, rows, "eval", output_path(run, iteration))  # as the eval stage does
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


def run_with_curve(root: Path, success: list[float], last_eval_wins: int) -> Path:
    """A run whose training rollouts succeeded ``success[i]`` in iteration i (64 held-out episodes
    evaluated before and after, ``last_eval_wins`` of them won at the end)."""
    run_with_evals(root, 32, last_eval_wins)
    for i, value in enumerate(success):
        folder = root / f"iter_{i:04d}"
        folder.mkdir(exist_ok=True)
        rows = pl.DataFrame(
            {"iter": [i], "stage": ["rollout"], "name": ["success_rate"], "value": [value], "task_type": [None]},
            schema={"iter": pl.Int32, "stage": pl.String, "name": pl.String, "value": pl.Float64,
                    "task_type": pl.String},
        )  # fmt: skip
        write_table(rows, "metrics", folder / "metrics_rollout.parquet")
    return root


def test_paired_differences_and_the_rule_hand_computed(tmp_path: Path) -> None:
    runs = {
        "graft-literal": [
            run_with_curve(tmp_path / "graft-literal-s0", [0.2, 0.4], 32),  # AUC 0.3
            run_with_curve(tmp_path / "graft-literal-s1", [0.5, 0.5], 32),  # AUC 0.5
        ],
        "graft-markov": [
            run_with_curve(tmp_path / "graft-markov-s0", [0.4, 0.8], 40),  # AUC 0.6: +0.3
            run_with_curve(tmp_path / "graft-markov-s1", [0.6, 0.6], 24),  # AUC 0.6: +0.1
        ],
        "graft-bootstrap": [  # seed 1 only: paired with the baseline's seed 1
            run_with_curve(tmp_path / "graft-bootstrap-s1", [0.6, 0.8], 32),  # AUC 0.7: +0.2
        ],
    }
    _, curves = success_table(runs, 1)
    table, auc = paired_differences(curves, runs, "graft-literal")
    # differences +0.3 and +0.1: mean 0.2, s.e. std([0.3, 0.1], ddof=1)/√2 = 0.1; held-out last
    # (40 - 32)/64 = +0.125 and (24 - 32)/64 = -0.125: mean 0, s.e. 0.125
    assert auc["graft-markov"] == pytest.approx((0.2, 0.1))
    markov = [c.strip() for c in table.splitlines()[2].split("|")[1:-1]]
    assert markov == ["graft-markov", "2", "+0.200 ± 0.100", "2 of 2", "+0.200 ± 0.100", "+0.000 ± 0.125"]
    assert auc["graft-bootstrap"][0] == pytest.approx(0.2) and np.isnan(auc["graft-bootstrap"][1])
    rule = paired_verdict(auc, "graft-literal")
    # 0.2 is not more than 2 s.e. = 0.2; one seed (no s.e.) is never ahead
    assert "graft-markov − graft-literal = +0.200 (2 paired s.e. = 0.200): not ahead" in rule
    assert "graft-bootstrap − graft-literal = +0.200 (2 paired s.e. = nan): not ahead" in rule
    assert "**ahead**" not in rule
    ahead = paired_verdict({"graft-markov": (0.2, 0.099)}, "graft-literal")
    assert "graft-markov − graft-literal = +0.200 (2 paired s.e. = 0.198): **ahead**" in ahead


def test_a_finished_run_is_kept_as_it_ran_not_reopened(tmp_path: Path, monkeypatch) -> None:
    # graft-s0 finished 2 iterations under an earlier config; asking for 2 again must not reopen it
    # (reopening refuses a changed config), asking for 3 must
    import bench.learning.runs as runs

    run_dir = tmp_path / "graft-s0"
    for k in range(2):
        (run_dir / f"iter_{k:04d}").mkdir(parents=True)
        (run_dir / f"iter_{k:04d}" / "metrics_loop.parquet").write_bytes(b"")
    opened: list[str] = []

    def refuse(config: str, run: str, *rest: object) -> None:
        opened.append(run)
        raise RuntimeError("reopened")

    monkeypatch.setattr(runs, "resolve_loop_run", refuse)
    assert runs.run_variant(Path("c.toml"), tmp_path, "graft", 0, 2, [], []) == (run_dir, 0.0)
    assert opened == []
    with pytest.raises(RuntimeError, match="reopened"):
        runs.run_variant(Path("c.toml"), tmp_path, "graft", 0, 3, [], [])
    assert opened == [str(run_dir)]


def test_run_record_rows_and_summary_hand_computed(tmp_path: Path) -> None:
    from bench.learning.run_record import record

    def metrics(values: dict[str, float], stage: str, iteration: int) -> pl.DataFrame:
        return pl.DataFrame(
            {
                "iter": [iteration] * len(values),
                "stage": [stage] * len(values),
                "name": list(values),
                "value": list(values.values()),
                "task_type": [None] * len(values),
            },
            schema_overrides={"task_type": pl.Utf8},
        )

    run = run_with_evals(tmp_path, initial_wins=32, last_wins=48)
    update = {"kl": 0.00012, "policy_kl": 0.002, "entropy": 0.25}
    # iteration 0 recomputed its rows (the token gap); iteration 1 took every pi_old from the rollout,
    # so only its probe's choice gap exists
    gaps = (
        {"engine_logprob_gap_mean": 0.0002, "engine_logprob_gap_max": 0.1},
        {"engine_choice_gap_mean": 0.0007, "engine_choice_gap_max": 0.3},
    )
    loop = {"seconds_rollout": 68.2, "seconds_update": 61.0, "seconds_iteration": 130.4}
    for k, success in enumerate((0.5, 0.75)):
        folder = run / f"iter_{k:04d}"
        folder.mkdir(exist_ok=True)
        rollout = {"success_rate": success, "valid_action_rate": 0.9}
        for stage, values in (("rollout", rollout), ("update", update | gaps[k]), ("loop", loop)):
            write_table(metrics(values, stage, k), "metrics", folder / f"metrics_{stage}.parquet")
        # group 0: node 0 -> 1 twice and -> 2 once (3 rows at a branching state), node 1 -> 3 once;
        # group 1: node 0 -> 1 three times (the same next state: not branching); 3 of 7 rows
        keys = {
            "group_id": ["0", "0", "0", "0", "1", "1", "1"],
            "traj_id": ["a", "b", "c", "a", "d", "e", "f"],
            "step": [0, 0, 0, 1, 0, 0, 0],
        }
        edges = pl.DataFrame(
            {**keys, "src": [0, 0, 0, 1, 0, 0, 0], "dst": [1, 1, 2, 3, 1, 1, 1], "reward": [0.0] * 7},
            schema_overrides={"step": pl.Int32, "src": pl.Int32, "dst": pl.Int32},
        )
        advantages = pl.DataFrame(
            {
                **keys,
                "estimator": ["grpo"] * 7,
                "td": [None] * 7,
                "gae": [None] * 7,
                "advantage": [0.0, 1.5, -0.5, 0.0, 0.0, 0.0, 0.0],
                "norm_group_size": [1] * 7,
            },
            schema_overrides={
                "step": pl.Int32,
                "td": pl.Float64,
                "gae": pl.Float64,
                "norm_group_size": pl.Int32,
            },
        )
        write_table(edges, "edges", folder / "edges.parquet")
        write_table(advantages, "advantages", folder / "advantages.parquet")
        write_manifest(open_run(run), k)  # a finished iteration is its manifest, as the loop writes it
    text = record(run)
    # held-out 32/64 initially, 48/64 after the checkpoint of iteration 1 (2 updates); AUC (0.5+0.75)/2
    assert "held-out initial success 0.500" in text
    assert "after 2 updates success **0.750**" in text
    assert "training-success AUC 0.625" in text
    assert "Draws against" not in text  # no episodes kept: nothing to pair
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert [c.strip() for c in rows[0].split("|")[1:-1]] == [
        "1",
        "0.750",
        "0.900",
        "0.0001",
        "0.0020",
        "0.43",
        "0.29",  # rows with A != 0: 2 of 7
        "0.250",
        "68",
        "61",
        "130",
        "7.0e-04 / 0.30",
    ]
    first = next(line for line in text.splitlines() if line.startswith("| 0 |"))
    assert first.split("|")[-2].strip() == "2.0e-04 / 0.10"


def test_run_record_counts_the_draws_gained_and_lost_on_common_draws(tmp_path: Path) -> None:
    from bench.learning.run_record import record
    from stages.evaluate import EPISODES_FILE, eval_episode_rows

    run = run_with_evals(tmp_path, initial_wins=3, last_wins=4, episodes=6)
    # initial wins t0 t1 t2; the last checkpoint wins t1 t3 t4 t5: t3 t4 t5 gained, t0 t2 lost
    outcomes = {-1: [1, 1, 1, 0, 0, 0], 1: [0, 1, 0, 1, 1, 1]}
    for iteration, won in outcomes.items():
        steps = one_turn_episodes(0, 6).with_columns(
            pl.Series("outcome", [10.0 * w for w in won]), pl.lit("task").alias("task_id")
        )
        folder = run if iteration < 0 else run / f"iter_{iteration:04d}"
        write_recorded_table(
            open_run(run),
            eval_episode_rows(steps, 10.0, iteration, "ck"),
            "eval_episodes",
            folder / EPISODES_FILE,
        )
    text = record(run)
    assert (
        "Draws against the initial policy (6 paired): 3 gained, 2 lost (1 won by both, 0 by neither)." in text
    )
    # episodes on other draws (e.g. eval.draws = "iteration") do not pair: no line
    other = one_turn_episodes(1, 6).with_columns(
        pl.Series("traj_id", [f"u{i}" for i in range(6)]), pl.lit("task").alias("task_id")
    )
    write_recorded_table(
        open_run(run),
        eval_episode_rows(other, 10.0, 1, "ck"),
        "eval_episodes",
        run / "iter_0001" / EPISODES_FILE,
    )
    assert "Draws against" not in record(run)


def test_oracle_shares_hand_computed(tmp_path: Path) -> None:
    from bench.learning.stats import oracle_shares

    def arm(name: str, aucs: list[float], wins: list[int]) -> list[Path]:
        return [
            run_with_curve(tmp_path / f"{name}-s{seed}", [auc, auc], w)
            for seed, (auc, w) in enumerate(zip(aucs, wins, strict=True))
        ]

    runs = {
        "grpo": arm("grpo", [0.2, 0.3, 0.4], [32, 32, 32]),
        "oracle": arm("oracle", [0.3, 0.5, 0.7], [40, 48, 56]),  # gains 0.1, 0.2, 0.3; held-out 1/8, 2/8, 3/8
        "graft": arm("graft", [0.25, 0.4, 0.55], [36, 40, 44]),  # half of every gain, seed by seed
        "gigpo": arm("gigpo", [0.2, 0.3, 0.4], [32, 32, 32]),  # none of it
    }
    _, curves = success_table(runs, 1)
    table = oracle_shares(curves, runs, "grpo")
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in table.splitlines()[2:4]}
    # proportional gains: every resample of the seeds gives the same ratio
    assert rows["graft"] == ["3", "0.50 [0.50, 0.50]", "0.50 [0.50, 0.50]"]
    assert rows["gigpo"] == ["3", "0.00 [0.00, 0.00]", "0.00 [0.00, 0.00]"]
    assert "Not measurements" not in table  # the oracle's gains (0.2 ± 0.058) are above 2 s.e.
    flat = {**runs, "oracle": arm("oracle-flat", [0.3, 0.2, 0.45], [32, 32, 32])}
    _, curves = success_table(flat, 1)
    assert "Not measurements where the oracle's own gain is not detectable" in oracle_shares(
        curves, flat, "grpo"
    )
    without = {k: v for k, v in flat.items() if k != "oracle"}
    assert oracle_shares({k: curves[k] for k in without}, without, "grpo") == ""
