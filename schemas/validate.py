"""The steps-table validation rules of docs/design.md §3, vectorized with polars.

Each rule finds its first offending row; the error names the file, the trajectory, the row and the
rule, e.g. ``runs/a/iter_0001/steps.parquet: trajectory 't3' (row 17): steps not contiguous from 0``.
"""

from __future__ import annotations

import polars as pl

from schemas.errors import GraftError

RULES = {
    "unique": "(traj_id, step) is not unique",
    "contiguous": "steps not contiguous from 0",
    "one_done": "not exactly one done row per trajectory, on its last step",
    "done_ends": "done row is neither terminated nor truncated",
    "chain": "next_state of step t differs from state of step t+1",
    "outcome": "outcome not constant within the trajectory",
    "group_task": "trajectories of one group have different task_id",
    "group_traj": "trajectory appears in more than one group",
    "finite": "reward or outcome is NaN or infinite",
}


# The columns the rules read (the policy columns are never looked at).
RULE_COLUMNS = (
    "group_id",
    "task_id",
    "traj_id",
    "step",
    "state",
    "next_state",
    "reward",
    "outcome",
    "done",
    "terminated",
    "truncated",
)


def _fail(source: str, rule: str, offenders: pl.DataFrame, detail: str = "") -> None:
    if offenders.height == 0:
        return
    first = offenders.row(0, named=True)
    where = f"trajectory '{first['traj_id']}' (row {first['_row']})"
    if "group_id" in first and rule == "group_task":
        where = f"group '{first['group_id']}', trajectory '{first['traj_id']}' (row {first['_row']})"
    extra = f": {detail.format(**first)}" if detail else ""
    raise GraftError(f"{source}: {where}: {RULES[rule]}{extra}")


def validate_steps(steps: pl.DataFrame, source: str = "<steps>") -> None:
    """Raise GraftError on the first violated steps rule; return None when the table is valid.

    Rows need not be sorted; ``_row`` in messages is the 0-based row index in the table as given.
    A valid table is recognized in one pass (``_all_rules_hold``); only a table that breaks a rule
    (or holds nulls) goes through the rule-by-rule search that names the first offender.
    """
    if steps.height == 0:
        raise GraftError(f"{source}: steps table has no rows")
    if _all_rules_hold(steps):
        return
    _first_violation(steps, source)


def _all_rules_hold(steps: pl.DataFrame) -> bool:
    """Every rule at once, as one boolean, over one sort by (group_id, traj_id, step).

    In that order each rule is a comparison with the neighbouring row: a row starts its trajectory iff
    its traj_id differs from the previous row's, and must then have step 0, else step = previous + 1
    (this covers uniqueness and contiguity); it ends its trajectory iff the next row's traj_id differs
    (done must equal that); within a trajectory next_state = next row's state, outcome and group_id
    equal the previous row's; a trajectory in two groups shows as a traj_id that starts twice, and
    within a group task_id equals the previous row's. Null comparisons count as violations, so the
    rule-by-rule search decides them.
    """
    same_traj = pl.col("traj_id") == pl.col("traj_id").shift(1)
    same_group = pl.col("group_id") == pl.col("group_id").shift(1)
    is_last = (pl.col("traj_id") != pl.col("traj_id").shift(-1)).fill_null(True)
    prev = lambda col: pl.col(col).shift(1)  # noqa: E731
    checks = [
        pl.col("reward").is_finite() & pl.col("outcome").is_finite(),
        pl.when(same_traj.fill_null(False))
        .then(
            (pl.col("step") == prev("step") + 1)
            & (pl.col("outcome") == prev("outcome"))
            & (pl.col("group_id") == prev("group_id"))
        )
        .otherwise(pl.col("step") == 0),
        pl.col("done") == is_last,
        ~pl.col("done") | pl.col("terminated") | pl.col("truncated"),
        is_last | (pl.col("next_state") == pl.col("state").shift(-1)),
        ~same_group.fill_null(False) | (pl.col("task_id") == prev("task_id")),
    ]
    ordered = steps.lazy().select(RULE_COLUMNS).sort("group_id", "traj_id", "step")
    flags = ordered.select(
        ok=pl.all_horizontal([c.fill_null(False) for c in checks]).all(),
        # a traj_id that starts more than once lies in two groups (the sort puts groups first)
        starts=(~same_traj.fill_null(False)).sum(),
        trajs=pl.col("traj_id").n_unique(),
    ).collect()
    return bool(flags["ok"][0]) and int(flags["starts"][0]) == int(flags["trajs"][0])


def _first_violation(steps: pl.DataFrame, source: str) -> None:
    """Check the rules one by one; raise GraftError naming the first offending row of the first rule."""
    df = steps.select(RULE_COLUMNS).with_row_index("_row")

    bad = df.filter(~pl.col("reward").is_finite() | ~pl.col("outcome").is_finite())
    _fail(source, "finite", bad, "reward={reward}, outcome={outcome}")

    dup = df.filter(pl.struct("traj_id", "step").is_duplicated())
    _fail(source, "unique", dup, "step {step} appears more than once")

    ordered = df.sort("traj_id", "step")
    ordered = ordered.with_columns(
        _expected=pl.int_range(pl.len()).over("traj_id").cast(pl.Int32),
        # the window must wrap the max (a max over a window expression is the global max)
        _is_last=(pl.col("step") == pl.col("step").max().over("traj_id")),
        _next_state_of_next=pl.col("state").shift(-1).over("traj_id"),
    )
    _fail(
        source,
        "contiguous",
        ordered.filter(pl.col("step") != pl.col("_expected")),
        "found step {step} where step {_expected} was expected",
    )
    _fail(
        source,
        "one_done",
        ordered.filter(pl.col("done") != pl.col("_is_last")),
        "step {step} has done={done}",
    )
    _fail(
        source,
        "done_ends",
        ordered.filter(pl.col("done") & ~pl.col("terminated") & ~pl.col("truncated")),
        "step {step}",
    )
    _fail(
        source,
        "chain",
        ordered.filter(~pl.col("_is_last") & (pl.col("next_state") != pl.col("_next_state_of_next"))),
        "step {step}",
    )
    _fail(
        source,
        "outcome",
        ordered.filter(pl.col("outcome") != pl.col("outcome").first().over("traj_id")),
        "step {step} has outcome {outcome}",
    )
    _fail(
        source,
        "group_traj",
        df.filter(pl.col("group_id") != pl.col("group_id").first().over("traj_id")),
        "also in group '{group_id}'",
    )
    _fail(
        source,
        "group_task",
        df.filter(pl.col("task_id") != pl.col("task_id").first().over("group_id")),
        "task_id '{task_id}'",
    )
