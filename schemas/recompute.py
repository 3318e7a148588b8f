"""Recomputing a stage of a run (the stage commands' ``--force``): check, ask, then remove.

Before anything is removed, ``guard_recompute`` checks what the recompute will read -- the files of
the iteration it keeps (against the finished iteration's manifest), the tables the stage reads
(against each other) and the checkpoint it acts with -- and whether the recompute can reproduce the
original at all (the update restores the optimizer state of the previous checkpoint, which
retention may have dropped). Only then, and once confirmed (a prompt, or ``--yes``), it removes what
was computed from the stage's output, newest first (``Run.dependent_outputs``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from schemas.atomic import remove_outputs
from schemas.confine import refuse_link_entries
from schemas.errors import GraftError
from schemas.initial_model import verify_recorded_models
from schemas.integrity import TRAINER_STATE_DIR, checkpoint_complete
from schemas.manifest import (
    acting_checkpoint,
    cross_check,
    forget_finished,
    producing_stage,
    verify_checkpoint_read,
    verify_finished,
)
from schemas.rundir import DERIVED_FILES, STAGE_OUTPUTS, STAGES, Run
from schemas.stage_table import STAGE_TABLE

# stages that act with (or train) the previous checkpoint's policy, and the tables of its own
# iteration each stage reads (schemas/stage_table.py)
ACTING_STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE if s.acts)
STAGE_INPUTS: dict[str, tuple[str, ...]] = {s.name: s.inputs for s in STAGE_TABLE}
NOTHING_REMOVED = "; --force removed nothing"


def replaced_files(run: Run, stage: str, iteration: int) -> set[str]:
    """Names of the iteration's files (and "checkpoint") a recompute of ``stage`` writes or removes."""
    names = {*STAGE_OUTPUTS[stage], *DERIVED_FILES[stage]}
    folder = run.iter_dir(iteration)
    for path in run.dependent_outputs(stage, iteration):
        if path.parent == folder:
            names.add(path.name)
        elif path == run.checkpoint_dir(iteration):
            names.add("checkpoint")
    return names


def check_recompute_inputs(run: Run, stage: str, iteration: int) -> None:
    """GraftError (one line, ending "--force removed nothing") when what a recompute of ``stage`` of
    ``iteration`` reads is not intact: a kept file of the finished iteration that differs from its
    manifest, input tables that disagree, or a damaged or missing acting checkpoint."""
    try:
        if iteration >= 0 and stage != "rollout":  # a replay replaces every file of the iteration
            missing = [t for t in STAGE_INPUTS[stage] if not run.table_path(iteration, t).is_file()]
            if missing:  # the recompute could not run: nothing computed from it is removed first
                raise GraftError(
                    f"{run.table_path(iteration, missing[0])}: missing, and the recompute of {stage} reads "
                    f"it; recompute it first (graft {producing_stage(missing[0] + '.parquet')} {run.root} "
                    f"--iter {iteration} --force)"
                )
            skip = {iteration: replaced_files(run, stage, iteration)}
            verify_finished(run, [iteration], skip=skip, root=False)
            cross_check(run, iteration, STAGE_INPUTS[stage])
        if stage in ACTING_STAGES:
            acting_checkpoint(run, iteration, stage)
            verify_recorded_models(run)  # the policy of iteration 0 and every update's reference
        elif stage == "eval" and iteration >= 0 and run.checkpoint_dir(iteration).exists():
            verify_checkpoint_read(run, iteration)
    except GraftError as exc:
        raise GraftError(f"{exc}{NOTHING_REMOVED}") from None


def lost_optimizer_state(run: Run, stage: str, iteration: int) -> Path | None:
    """The checkpoint whose optimizer state the recomputed update of ``iteration`` would continue from
    but which retention dropped (None: nothing is lost). The original update restored it, so the
    recompute, restarting AdamW and its step count, cannot reproduce it."""
    if stage not in STAGES or iteration < 1:
        return None
    if not (run.stage_complete("update", iteration) or run.table_path(iteration, "update").is_file()):
        return None  # no update of the iteration to reproduce
    previous = run.checkpoint_dir(iteration - 1)
    if checkpoint_complete(previous) and not (previous / TRAINER_STATE_DIR).is_dir():
        return previous
    return None


def guard_recompute(
    run: Run, stage: str, iteration: int, force: bool, confirm: Callable[[str], bool] | None = None
) -> list[Path]:
    """Before a stage command recomputes ``stage`` of ``iteration``: refuse (GraftError) when its output is
    finished or anything computed from it exists, unless ``force``; with ``force`` check what the
    recompute reads (``check_recompute_inputs``), then remove what depends on the stage's output
    (``Run.dependent_outputs``) and return the removed paths.

    A recomputed stage would otherwise leave later stages and iterations built on the old output: a
    run that silently mixes two histories (e.g. advantages of 133 steps next to a steps table of 146).
    ``confirm(statement)`` is asked before later iterations are removed and before a recompute that
    cannot reproduce the original (the CLI: a prompt, or ``--yes``); False removes nothing.
    """
    finished = run.stage_complete(stage, iteration) if iteration >= 0 else run.initial_eval_path.is_file()
    dependents = run.dependent_outputs(stage, iteration)
    if not force and (finished or dependents):
        what = (
            f"{stage} of iteration {iteration} is finished"
            if finished
            else f"{stage} of iteration {iteration} has later outputs"
        )
        tail = (
            f" and remove what depends on it: {describe_outputs(run, iteration, dependents)}"
            if dependents
            else ""
        )
        raise GraftError(f"{run.root}: {what}; use --force to recompute it{tail}")
    if not force:
        return []
    # nothing is removed or replaced through a link inside the run (schemas.confine), checked first
    refuse_link_entries([*dependents, *run.output_paths(stage, iteration)] if iteration >= 0 else dependents)
    if finished or dependents:
        check_recompute_inputs(run, stage, iteration)
    questions = []
    lost = lost_optimizer_state(run, stage, iteration) if (finished or dependents) else None
    if lost is not None:
        questions.append(
            f"{lost}: its optimizer state ({TRAINER_STATE_DIR}/) was dropped by checkpoint retention, so "
            f"the recomputed update of iteration {iteration} restarts AdamW and its step count and cannot "
            "reproduce the original"
        )
    later = [p for p in dependents if p.name.startswith("iter_") and p.name != run.iter_dir(iteration).name]
    if later:
        questions.append(f"--force removes {describe_outputs(run, iteration, dependents)}")
    for question in questions:
        if confirm is not None and not confirm(question):
            raise GraftError(
                f"{question}; --force not confirmed; nothing was removed (pass --yes to confirm)"
            )
    if dependents and stage != "eval":
        forget_finished(run, iteration)  # before a done-marker goes: the record never names a gone one
    remove_outputs(dependents)
    return dependents


def describe_outputs(run: Run, iteration: int, paths: list[Path]) -> str:
    """``iter_0003/{nodes,edges,...}.parquet, checkpoints/iter_0003, iterations 4..9`` for dependents."""
    inside = [
        p for p in reversed(paths) if p.parent == run.iter_dir(iteration) and not p.name.startswith(".")
    ]
    parts = []
    if inside:
        parts.append(f"{run.iter_dir(iteration).name}/{{{','.join(p.name for p in inside)}}}")
    if run.checkpoint_dir(iteration) in paths:
        parts.append(f"checkpoints/{run.checkpoint_dir(iteration).name}")
    later = sorted(
        {int(p.name[5:]) for p in paths if p.name.startswith("iter_") and p.name[5:].isdigit()} - {iteration}
    )
    if later:
        span = f"{later[0]}" if len(later) == 1 else f"{later[0]}..{later[-1]}"
        parts.append(f"iteration{'s' if len(later) > 1 else ''} {span} with their checkpoints")
    return ", ".join(parts)


def removed_summary(run: Run, iteration: int, paths: list[Path]) -> str:
    """``removed what was computed from it: ...`` ('' when nothing was removed)."""
    return f"removed what was computed from it: {describe_outputs(run, iteration, paths)}" if paths else ""
