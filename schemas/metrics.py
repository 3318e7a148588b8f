"""Rows of the ``metrics`` table (iter, stage, name, value, task_type): the one constructor every stage
writes its metrics with."""

from __future__ import annotations

import polars as pl


def metrics_frame(
    iteration: int, stage: str, metrics: dict[str, float], task_type: str | None = None
) -> pl.DataFrame:
    """Rows of the ``metrics`` table (iter, stage, name, value, task_type) for one stage."""
    return pl.DataFrame(
        {
            "iter": pl.Series([iteration] * len(metrics), dtype=pl.Int32),
            "stage": pl.Series([stage] * len(metrics), dtype=pl.String),
            "name": pl.Series(list(metrics), dtype=pl.String),
            "value": pl.Series([float(v) for v in metrics.values()], dtype=pl.Float64),
            "task_type": pl.Series([task_type] * len(metrics), dtype=pl.String),
        }
    )
