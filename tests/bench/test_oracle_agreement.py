"""bench/probes/oracle_agreement.py: agreement of a credit with the oracle's, by hand."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from bench.probes.oracle_agreement import agreement, oracle_noise


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
