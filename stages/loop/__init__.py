"""The training loop (docs/loop.md): ``stage`` (``run_stage``: the one way a stage of a run is run, by
the loop and by the stage commands), ``runner`` (rollout → graph → solve → advantage → update per
iteration, resumable, with evaluation on schedule), ``commands`` (what the stage commands ask of a run
beyond one stage), ``preflight`` (what a start checks before it writes
anything) and ``start`` (creating or reopening the run of ``graft loop``: the lock, and which config
changes do not count when a run resumes)."""

from stages.loop.preflight import check_startable
from stages.loop.runner import (
    STAGE_RUNNERS,
    IterationResult,
    StageRunner,
    check_resumable,
    eval_due,
    iteration_summary,
    remove_stale_temporaries,
    run_iteration,
    run_loop,
)
from stages.loop.stage import StageCommand, run_stage, uses_initial_policy
from stages.loop.start import locked_start, loop_root, open_loop_run, resolve_loop_run

__all__ = [
    "STAGE_RUNNERS",
    "IterationResult",
    "StageCommand",
    "StageRunner",
    "check_resumable",
    "check_startable",
    "eval_due",
    "iteration_summary",
    "locked_start",
    "loop_root",
    "open_loop_run",
    "remove_stale_temporaries",
    "resolve_loop_run",
    "run_iteration",
    "run_loop",
    "run_stage",
    "uses_initial_policy",
]
