"""Hand-built steps tables for the credit-stage tests (graph, solve, advantage, CLI)."""

from __future__ import annotations

from typing import Any

import polars as pl
from hypothesis import strategies as st

from schemas import conform

Step = tuple[str, str, float]  # (state, next_state, reward)


def make_steps(
    trajectories: list[tuple[str, list[Step], float, str]], group: str = "g", task: str = "task"
) -> pl.DataFrame:
    """A steps table from (traj_id, [(state, next_state, reward), ...], outcome, how) tuples.

    ``how`` is how the last step ends: "terminated", "truncated" or "both".
    """
    rows = []
    for traj, steps, outcome, how in trajectories:
        for t, (state, next_state, reward) in enumerate(steps):
            last = t == len(steps) - 1
            rows.append(
                {
                    "iter": 0,
                    "group_id": group,
                    "task_id": task,
                    "task_type": "",
                    "traj_id": traj,
                    "step": t,
                    "state": state,
                    "next_state": next_state,
                    "observation": state,
                    "action": f"{state}->{next_state}",
                    "valid": reward == 0.0,
                    "reward": reward,
                    "outcome": outcome,
                    "done": last,
                    "terminated": last and how in ("terminated", "both"),
                    "truncated": last and how in ("truncated", "both"),
                }
            )
    return pl.from_arrow(conform(pl.DataFrame(rows), "steps"))  # type: ignore[return-value]


def fig2_steps() -> pl.DataFrame:
    """The hand example in the spirit of the paper's Fig. 2 (values worked out in the tests).

    From S, the "detour" L is worse than D. T1 succeeds through L (an erroneous step in a successful
    trajectory), T2 fails through D (a good step in a failed one); T4 makes an invalid action at L
    (self-loop, reward -0.1); T6 is cut right after reaching D (truncated, outcome 0), so D mixes an
    end with continuations. Rows r0..r11 in this order:

        T1: r0 S->L, r1 L->G            R=1
        T2: r2 S->D, r3 D->F            R=0
        T3: r4 S->D, r5 D->G            R=1
        T4: r6 S->L, r7 L->L (-0.1), r8 L->F   R=0
        T5: r9 S->D, r10 D->G           R=1
        T6: r11 S->D (truncated)        R=0
    """
    return make_steps(
        [
            ("T1", [("S", "L", 0.0), ("L", "G", 0.0)], 1.0, "terminated"),
            ("T2", [("S", "D", 0.0), ("D", "F", 0.0)], 0.0, "terminated"),
            ("T3", [("S", "D", 0.0), ("D", "G", 0.0)], 1.0, "terminated"),
            ("T4", [("S", "L", 0.0), ("L", "L", -0.1), ("L", "F", 0.0)], 0.0, "terminated"),
            ("T5", [("S", "D", 0.0), ("D", "G", 0.0)], 1.0, "terminated"),
            ("T6", [("S", "D", 0.0)], 0.0, "truncated"),
        ]
    )


def synth_knobs(**extra: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``synth_steps`` keyword arguments drawn by hypothesis: small random MDP groups (+ ``extra``)."""
    return st.fixed_dictionaries(
        {
            "groups": st.integers(1, 3),
            "group_size": st.integers(1, 8),
            "horizon": st.integers(2, 9),
            "width": st.integers(1, 4),
            "merge": st.floats(0, 1),
            "cycles": st.floats(0, 0.6),
            "invalid_rate": st.floats(0, 0.5),
            "truncation": st.floats(0, 1),
            "seed": st.integers(0, 10_000),
            **extra,
        }
    )
