"""Checkpoint retention (``[checkpoint] keep_last / keep_every``; docs/loop.md "Checkpoint retention").

Every update writes full float32 weights plus AdamW moments (3x the weights); a 1.5B model over 150
iterations would need terabytes. With ``keep_last = N >= 1`` the loop keeps, after each finished
iteration, only

* the N newest complete checkpoints (N >= 1 keeps the newest: the acting policy of the next iteration,
  all a resumed run reads);
* with ``keep_every = K``, the checkpoint after every K-th update (iteration i with (i + 1) % K == 0,
  the loop's evaluation schedule);
* the checkpoints of evaluated iterations (``iter_NNNN/eval.parquet`` exists), so what the report
  shows can be evaluated again;
* a full checkpoint that a kept LoRA checkpoint adapts (LoRA switched on mid-run);

and drops the optimizer state (``trainer_state/``) from all but the newest: only the next update
restores it. The marker of such a checkpoint is rewritten without those files first, so every kept
checkpoint still verifies against its checksums. Pruned checkpoints are never read again, so a run with retention ends with the same
tables as one without (tested in tests/update/test_retention.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from schemas.atomic import remove_outputs
from schemas.config import CheckpointConfig
from schemas.confine import refuse_link_entries
from schemas.integrity import checkpoint_complete, forget_checkpoint_files
from schemas.rundir import Run
from stages.policy.adapters import adapter_base, is_adapter_dir
from stages.update.checkpoint import TRAINER_STATE_DIR


def retained_checkpoints(
    iterations: list[int], evaluated: set[int], keep_last: int, keep_every: int
) -> set[int]:
    """The iterations whose checkpoints stay: all when ``keep_last == 0``; else the ``keep_last``
    newest, every i with (i + 1) % keep_every == 0 (keep_every > 0) and the evaluated ones."""
    if keep_last <= 0:
        return set(iterations)
    ordered = sorted(iterations)
    keep = set(ordered[-keep_last:])
    if keep_every > 0:
        keep |= {i for i in ordered if (i + 1) % keep_every == 0}
    return keep | (set(ordered) & evaluated)


def lora_bases(run: Run, kept: set[int]) -> set[int]:
    """Iterations whose full checkpoint is the base of a kept LoRA checkpoint (LoRA switched on in the
    middle of a run): the adapters are nothing without it."""
    bases = set()
    for i in kept:
        checkpoint = run.checkpoint_dir(i)
        if is_adapter_dir(checkpoint):
            base = adapter_base(checkpoint)
            if base.parent == run.checkpoint_dir(0).parent.resolve() and base.name[5:].isdigit():
                bases.add(int(base.name[5:]))
    return bases


def prune_checkpoints(run: Run, cfg: CheckpointConfig) -> list[Path]:
    """Apply retention to the run's complete checkpoints; returns the removed paths (none when
    ``keep_last == 0``). Incomplete checkpoint directories are left to the loop's cleanup."""
    if cfg.keep_last <= 0:
        return []
    complete = [i for i in run.checkpoint_iterations() if checkpoint_complete(run.checkpoint_dir(i))]
    if not complete:
        return []
    evaluated = {i for i in complete if run.table_path(i, "eval").is_file()}
    keep = retained_checkpoints(complete, evaluated, cfg.keep_last, cfg.keep_every)
    keep |= lora_bases(run, keep)
    newest = max(complete)
    dropped = [run.checkpoint_dir(i) for i in sorted(complete) if i not in keep]
    remove_outputs(dropped)  # renamed to a temporary name first: never half a checkpoint in place
    states = [
        state
        for i in sorted(keep)
        if i != newest and (state := run.checkpoint_dir(i) / TRAINER_STATE_DIR).is_dir()
    ]
    for state in states:
        # the marker first: a kill after it leaves unlisted files (harmless; the next prune removes
        # them), never a marker that lists files which are gone
        forget_checkpoint_files(state.parent, TRAINER_STATE_DIR)
        refuse_link_entries([state])  # never through a link (schemas.confine)
        shutil.rmtree(state, ignore_errors=True)
    return dropped + states
