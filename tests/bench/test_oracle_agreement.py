"""bench/probes/oracle_agreement.py: agreement of a credit with the oracle's, by hand."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from bench.probes.oracle_agreement import agreement, oracle_noise, oracle_noise_rows


def test_agreement_by_hand():
    oracle = np.array([1.0, -1.0, 0.0, 2.0])
    other = np.array([0.5, 0.0, 3.0, -1.0])
    m = agreement(oracle, other)
    # rows with oracle A != 0: 0, 1, 3; same sign on row 0 only (a 0 is a disagreement)
    assert m["sign"] == pytest.approx(1 / 3)
    assert m["credited"] == pytest.approx(2 / 3)
    assert m["corr"] == pytest.approx(np.corrcoef(oracle, other)[0, 1])
    unit = oracle / oracle.std() - other / other.std()
    assert m["mse"] == pytest.approx(np.mean(unit**2))


def test_oracle_noise_adds_both_ends_of_a_step():
    steps = pl.DataFrame(
        {
            "group_id": ["g", "g"],
            "step": [0, 1],
            "state": ["a", "b"],
            "next_state": ["b", "end"],
            "done": [False, True],
        }
    )
    table = pl.DataFrame(
        {
            "group_id": ["g", "g"],
            "step": [0, 1],
            "state": ["a", "b"],
            "return_std": [2.0, 4.0],
            "continuations": [4, 8],
        }
    )
    # row 0: 4/4 + γ² 16/8; row 1 (ends): 16/8
    gamma = 0.5
    assert oracle_noise(steps, table, gamma) == pytest.approx(((1.0 + gamma**2 * 2.0) + 2.0) / 2)
    assert oracle_noise_rows(steps, table, gamma).tolist() == pytest.approx([1.0 + gamma**2 * 2.0, 2.0])


def test_turn_parts_by_hand():
    from bench.probes.oracle_agreement import turn_part

    labels = turn_part(np.array([0, 1, 3, 4, 9]))
    assert labels.tolist() == ["turn 1", "turns 2–4", "turns 2–4", "turns 5+", "turns 5+"]


def _six_turn_iteration(tmp_path):
    """Two 6-turn trajectories of one group from a shared start (a wins, b does not), written as an
    oracle run's iteration: steps.parquet and oracle.parquet with hand-set continuation returns."""
    from schemas import conform, write_table
    from stages.credit.advantage.oracle import oracle_starts, oracle_table

    base = {"iter": 0, "group_id": "g", "task_id": "t", "task_type": "", "observation": "", "valid": True}
    rows = []
    for traj, outcome in (("a", 10.0), ("b", 0.0)):
        for step in range(6):
            state = "s0" if step == 0 else f"{traj}{step}"
            rows.append({
                **base, "traj_id": traj, "step": step, "state": state, "next_state": f"{traj}{step + 1}",
                "action": f"{traj}-act{step}", "reward": 0.0, "outcome": outcome, "done": step == 5,
            })  # fmt: skip
    table = pl.DataFrame(rows).with_columns(terminated=pl.col("done"), truncated=pl.lit(False))
    steps = pl.from_arrow(conform(table, "steps", source="test"))
    starts = oracle_starts(steps)
    rng = np.random.default_rng(0)
    returns = [rng.uniform(0.0, 10.0, size=4) for _ in range(starts.height)]
    table = oracle_table(starts, returns)
    write_table(steps, "steps", tmp_path / "steps.parquet")
    write_table(table, "oracle", tmp_path / "oracle.parquet")
    return steps, table


def test_agreement_by_turn_equals_agreement_on_each_part(tmp_path):
    """Each part's row equals agreement() on that part's rows alone; the oracle's reliability per part
    comes from that part's own rows (per-row noise)."""
    from bench.probes.oracle_agreement import iteration_agreement
    from schemas.config import Config
    from stages import credit
    from stages.credit.advantage.oracle import oracle_step_advantages

    steps, table = _six_turn_iteration(tmp_path)
    config = Config()
    oracle_a = oracle_step_advantages(steps, table, config.solve.gamma)
    adv = credit.advantages(steps, estimator="grpo", gamma=config.solve.gamma)["advantage"].to_numpy()
    noise = oracle_noise_rows(steps, table, config.solve.gamma)
    step = steps["step"].to_numpy()

    out = {
        (r["part"], r["estimator"]): r for r in iteration_agreement(tmp_path, config, ["grpo"], by_turn=True)
    }
    assert {p for p, _ in out} == {"turn 1", "turns 2–4", "turns 5+"}
    for part, rows in (
        ("turn 1", step == 0),
        ("turns 2–4", (step >= 1) & (step <= 3)),
        ("turns 5+", step >= 4),
    ):
        expected = agreement(oracle_a[rows], adv[rows])
        got = out[(part, "grpo")]
        for key in ("sign", "credited", "mse", "rows"):
            assert got[key] == pytest.approx(expected[key], nan_ok=True)
        var = np.var(oracle_a[rows])
        assert out[(part, "oracle itself")]["corr"] == pytest.approx(
            np.sqrt(max(0.0, 1 - noise[rows].mean() / var))
        )
        assert out[(part, "oracle itself")]["rows"] == rows.sum()

    whole = iteration_agreement(tmp_path, config, ["grpo"])
    assert [r["part"] for r in whole] == ["all turns", "all turns"]
    assert whole[0]["corr"] == pytest.approx(agreement(oracle_a, adv)["corr"])
