"""``graft export RUN --iter N -o DIR``: a checkpoint's policy as a plain Hugging Face model directory.

A full checkpoint is copied without graft's trainer state and marker; a LoRA checkpoint is merged
into its base first (stages/policy/adapters.py). The result loads with
``AutoModelForCausalLM.from_pretrained(DIR)`` and with vLLM, and acts exactly like the checkpoint does
in graft's own rollouts (tests/test_lora.py compares log-probs).
"""

from __future__ import annotations

from pathlib import Path

from schemas.errors import GraftError
from schemas.rundir import checkpoint_complete, open_run
from stages.policy.adapters import export_merged


def export_checkpoint(run_dir: str | Path, iteration: int, out: str | Path) -> tuple[Path, Path]:
    """Export the checkpoint of ``iteration`` (-1: the newest complete one); returns (out, checkpoint)."""
    run = open_run(run_dir)
    if iteration < -1:
        raise GraftError(f"--iter {iteration}: iterations are >= 0 (or -1 for the newest checkpoint)")
    if iteration == -1:
        checkpoint = run.latest_checkpoint()
        if checkpoint is None:
            raise GraftError(f"{run.root}: no complete checkpoint to export (run graft update first)")
    else:
        checkpoint = run.checkpoint_dir(iteration)
        if not checkpoint_complete(checkpoint):
            raise GraftError(f"{checkpoint}: not a complete checkpoint (was iteration {iteration} updated?)")
    config = run.load_config([])
    return export_merged(checkpoint, out, config.model.trust_remote_code), checkpoint
