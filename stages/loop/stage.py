"""One way to run a stage of a run, for the loop and the stage commands alike (docs/design.md §2
"Stage runners").

``run_stage`` runs one stage of one iteration as the table of stages describes it: under the run's
lock it refuses to recompute a finished stage unless asked (a stage command's ``--force``, which
removes what depends on it first), prepares the initial policy where the stage uses it (one rule:
``uses_initial_policy``), makes the iteration's manifest forget the files the stage rewrites, runs the
stage's runner, checks that the stage's outputs exist, and records a command's ``--set`` items. The
loop calls it for every stage it runs; ``graft rollout|graph|solve|advantage|update|eval`` call it
(through ``stages.loop.commands`` where a command runs more than one stage).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from schemas.config import Config
from schemas.errors import GraftError
from schemas.lock import run_lock
from schemas.manifest import forget_rewritten
from schemas.recompute import STAGE_INPUTS, guard_recompute
from schemas.rundir import DERIVED_FILES, STAGE_NAMES, STAGE_OUTPUTS, STAGES, Run, record_overrides
from schemas.stage_table import STAGE_TABLE
from stages.credit import run_advantage, run_graph, run_solve
from stages.evaluate import run_eval
from stages.policy.live_engine import engine_released_for_update, release_engines
from stages.rollout import run_rollout
from stages.update.launch import loop_update
from stages.warmstart import initial

StageRunner = Callable[[Run, int, Config], None]
Prepare = Callable[[Run, Config], object]

# The function of each stage of schemas/stage_table.py, in its order: the stages of one iteration and
# the evaluation that may follow them.
STAGE_RUNNERS: dict[str, StageRunner] = {
    "rollout": run_rollout,
    "graph": run_graph,
    "solve": run_solve,
    "advantage": run_advantage,
    "update": loop_update,  # run_update, or under torchrun with cluster.update_procs > 1
    "eval": run_eval,
}


def check_runners(runners: dict[str, StageRunner]) -> None:
    """GraftError unless ``runners`` names exactly the stages of the table of stages, in its order."""
    if tuple(runners) != STAGE_NAMES:
        missing = [s for s in STAGE_NAMES if s not in runners]
        extra = [s for s in runners if s not in STAGE_NAMES]
        raise GraftError(
            f"stage runners {list(runners)} do not match the table of stages {list(STAGE_NAMES)} "
            f"(schemas/stage_table.py; without a runner: {missing}, not in the table: {extra})"
        )


check_runners(STAGE_RUNNERS)  # a stage added to the table without a runner stops the import

# the stage whose outputs hold each table of an iteration (schemas/stage_table.py)
_MADE_BY: dict[str, str] = {t: s.name for s in STAGE_TABLE for t in s.tables}
_ACTS: dict[str, bool] = {s.name: s.acts for s in STAGE_TABLE}


def uses_initial_policy(stage: str, iteration: int) -> bool:
    """The one rule for when a stage needs the run's initial policy made first (``ensure_initial_model``:
    the tiny model or ``model.path``, then the warm start): when it acts with it (a stage that acts,
    in iteration 0: ``acting_policy`` gives the initial policy there), trains against it (the update
    in every iteration: it is the KL reference) or scores it (the evaluation of iteration -1)."""
    if stage == "update":
        return True
    if _ACTS.get(stage, False):
        return iteration == 0
    return stage == "eval" and iteration < 0


@dataclass(frozen=True)
class StageCommand:
    """What a stage command adds to a run of a stage: ``--force`` (recompute a finished stage, removing
    what depends on it), the confirmation asked before removing later iterations (``--yes``: None
    asks nothing) and the ``--set`` items, recorded beside the stage's outputs."""

    force: bool = False
    confirm: Callable[[str], bool] | None = None
    overrides: Sequence[str] = ()


@dataclass
class StageDone:
    """What ``run_stage`` did: the paths a command's ``--force`` removed and the stage's seconds (the
    runner and its checks; preparing the initial policy is not the stage's time)."""

    removed: list[Path] = field(default_factory=list)
    seconds: float = 0.0


def distributed_rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0"))


def run_stage(
    run: Run,
    stage: str,
    iteration: int,
    config: Config,
    *,
    runner: StageRunner | None = None,
    command: StageCommand | None = None,
    prepare: Prepare | None = None,
    shard: bool = False,
) -> StageDone:
    """Run ``stage`` of ``iteration`` of ``run`` (iteration -1: the evaluation of the initial policy).

    ``runner``: the stage's function (default ``STAGE_RUNNERS[stage]``; the loop passes its own table,
    tests pass fakes); ``prepare``: what makes the initial policy (default ``ensure_initial_model``),
    called when ``uses_initial_policy``; ``command``: a stage command's call -- a finished stage is
    refused without ``command.force`` and what depends on it is removed with it (``guard_recompute``;
    the evaluation, a leaf, is refused by its caller, which knows the file it writes), and the
    ``--set`` items are recorded (``overrides_<stage>.json``); None: the loop's call, which runs only
    stages it found missing or damaged. ``shard``: one worker's share of the rollout (a shared lock; the
    stage is complete only when the last share is merged). Under torchrun a rank other than 0 only
    runs the runner: rank 0 holds the lock and guards, prepares and records for all.
    """
    run_it = STAGE_RUNNERS[stage] if runner is None else runner
    if command is not None and distributed_rank() != 0:
        run_it(run, iteration, config)
        return StageDone()
    done = StageDone()
    with run_lock(run.root, shared=shard):
        if command is not None and stage in STAGES and not shard:
            check_inputs_made(run, stage, iteration)
            done.removed = guard_recompute(run, stage, iteration, command.force, command.confirm)
        if uses_initial_policy(stage, iteration):
            (initial.ensure_initial_model if prepare is None else prepare)(run, config)
        start = time.perf_counter()
        if stage in ("update", "eval") and engine_released_for_update(config):
            release_engines()  # the update (or the evaluation's own engine) gets the memory
        if iteration >= 0:
            forget_rewritten(run, iteration, (*STAGE_OUTPUTS[stage], *DERIVED_FILES[stage]))
        run_it(run, iteration, config)
        if iteration >= 0 and not shard and not run.stage_complete(stage, iteration):
            missing = [str(p) for p in run.output_paths(stage, iteration) if not p.exists()]
            raise GraftError(f"stage {stage} of iteration {iteration} finished without {', '.join(missing)}")
        done.seconds = time.perf_counter() - start
        if command is not None and stage in STAGES and not shard:
            record_overrides(run, iteration, stage, tuple(command.overrides))
    return done


def check_inputs_made(run: Run, stage: str, iteration: int) -> None:
    """GraftError naming the stage to run first when an unfinished ``stage`` of ``iteration`` would read
    a table of the iteration that an earlier stage has not written yet."""
    if run.stage_complete(stage, iteration):
        return  # a finished stage: the recompute's own checks (guard_recompute) look at its inputs
    for table in STAGE_INPUTS[stage]:
        maker = _MADE_BY.get(table)
        if maker is not None and maker != stage and not run.stage_complete(maker, iteration):
            outputs = run.output_paths(maker, iteration)
            missing = next((p for p in outputs if not p.exists()), outputs[0])
            raise GraftError(
                f"{stage}: iteration {iteration} of {run.root} has no {maker} yet (no {missing}); run "
                f"graft {maker} {run.root} --iter {iteration} first"
            )
