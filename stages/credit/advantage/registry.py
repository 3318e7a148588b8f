"""The estimator registry and the types every estimator shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from schemas.config import AdvantageConfig, allow_estimator
from schemas.errors import GraftError

if TYPE_CHECKING:
    from stages.credit.bellman import GraphIndex


@dataclass(frozen=True)
class CreditInputs:
    """Everything an estimator may use, row-aligned with the steps table.

    steps:  the steps table (n rows, any order; estimators keep that order)
    edges:  edges table, same n rows and order (src/dst node per row, per group)
    nodes:  nodes table (per group)
    values: values table (per group, per node) -- None for estimators that need no graph values
    gamma:  discount of the graph solve (docs/design.md §4)
    index:  stages.credit.bellman.index_graph(nodes, edges) when the caller already has it (else None)
    step_rewards: solve.step_rewards the values were solved with ("step": r_t is not inside V)
    oracle: the ``oracle`` table of Monte-Carlo state values (bench oracles only; None otherwise)
    """

    steps: pl.DataFrame
    edges: pl.DataFrame
    nodes: pl.DataFrame
    values: pl.DataFrame | None
    gamma: float
    index: GraphIndex | None = None
    step_rewards: str = "step"
    oracle: pl.DataFrame | None = None


@dataclass(frozen=True)
class CreditOutput:
    """Per-row credit, each array of shape (n,) aligned with ``CreditInputs.steps``.

    td / gae are None for estimators that do not produce them (stored as nulls).
    """

    advantage: np.ndarray  # float64, what the loss uses
    norm_group_size: np.ndarray  # int32, size of the normalization group of the row (1 if none)
    td: np.ndarray | None = None
    gae: np.ndarray | None = None


Estimator = Callable[[CreditInputs, AdvantageConfig], CreditOutput]

ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: add an estimator to the registry under ``name``; a name already taken is refused
    (a second estimator would silently replace the first for every run that names it)."""

    def wrap(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            taken = ESTIMATORS[name]
            raise GraftError(
                f"estimator '{name}' is already registered (by {taken.__module__}.{taken.__qualname__}); "
                "register it under another name"
            )
        ESTIMATORS[name] = fn
        allow_estimator(name)  # a valid advantage.estimator from now on
        return fn

    return wrap


def get_estimator(name: str) -> Estimator:
    """Look up an estimator; unknown names are a GraftError listing the known ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise GraftError(
            f"unknown advantage.estimator '{name}'; estimators: {', '.join(sorted(ESTIMATORS))}"
        ) from None
