"""The one table of stages (docs/design.md §8): every per-stage list of the project derives from it.

``STAGE_TABLE`` holds the stages of one iteration in order (``in_iteration``), then the evaluation
that may follow them. What reads it:

* ``schemas.rundir``: ``STAGE_NAMES`` (all, in order), ``STAGES`` (the iteration's), ``STAGE_OUTPUTS``,
  ``DERIVED_FILES``, ``STAGE_LABELS``;
* ``schemas.recompute``: ``STAGE_INPUTS``, ``ACTING_STAGES``;
* ``stages.loop.runner``: ``STAGE_TABLES``, and ``STAGE_RUNNERS`` (the functions, which live in
  stages/) is checked at import to name exactly these stages in this order;
* ``graft loop``'s line of seconds per stage reads ``STAGE_LABELS``.

A stage added here appears in all of them (tests/schemas/test_stage_table.py); the loop refuses to
import until it has a runner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One stage of the loop and the files it owns in ``iter_NNNN/``."""

    name: str
    # main outputs, relative to iter_NNNN/ ("checkpoint" = checkpoints/iter_NNNN); all exist = complete
    outputs: tuple[str, ...]
    # other files it writes into iter_NNNN/ (removed with its outputs when an earlier stage is
    # recomputed; the reference log-prob cache of the update is checked against row keys only)
    derived_files: tuple[str, ...]
    # its tables the loop checks against each other before resuming an iteration
    tables: tuple[str, ...]
    # the tables of its own iteration it reads
    inputs: tuple[str, ...]
    label: str  # its short name in the loop's line of seconds per stage
    in_iteration: bool = True  # False: runs after the iteration's stages when due (the evaluation)
    acts: bool = False  # acts with (or trains) the previous checkpoint's policy


STAGE_TABLE: tuple[Stage, ...] = (
    Stage(
        "rollout",
        outputs=("steps.parquet",),
        # oracle.parquet: the bench oracle's continuations (advantage.estimator = "oracle" only)
        derived_files=("metrics_rollout.parquet", "overrides_rollout.json", "oracle.parquet"),
        tables=("steps",),
        inputs=(),
        label="roll",
        acts=True,
    ),
    Stage(
        "graph",
        outputs=("nodes.parquet", "edges.parquet"),
        derived_files=("metrics_graph.parquet", "overrides_graph.json"),
        tables=("nodes", "edges"),
        inputs=("steps",),
        label="graph",
    ),
    Stage(
        "solve",
        outputs=("values.parquet",),
        derived_files=("metrics_solve.parquet", "overrides_solve.json"),
        tables=("values",),
        inputs=("nodes", "edges"),
        label="solve",
    ),
    Stage(
        "advantage",
        outputs=("advantages.parquet",),
        derived_files=("metrics_advantage.parquet", "overrides_advantage.json"),
        tables=("advantages",),
        inputs=("steps", "nodes", "edges", "values"),
        label="adv",
    ),
    Stage(
        "update",
        outputs=("update.parquet", "checkpoint"),
        derived_files=("metrics_update.parquet", "reflogprobs.parquet", "overrides_update.json"),
        tables=(),
        inputs=("steps", "advantages"),
        label="upd",
        acts=True,
    ),
    Stage(
        "eval",
        outputs=("eval.parquet",),
        derived_files=("eval_episodes.parquet", "overrides_eval.json"),
        tables=(),
        inputs=(),
        label="eval",
        in_iteration=False,
    ),
)
