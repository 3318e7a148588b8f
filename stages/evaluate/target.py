"""What ``graft eval`` evaluates: its ``--checkpoint`` / ``--iter`` resolved to a model and the file
its rows go to."""

from __future__ import annotations

from pathlib import Path

from schemas.config import Config
from schemas.definitions import INITIAL_VERSION
from schemas.errors import GraftError
from schemas.integrity import checkpoint_complete, verify_checkpoint
from schemas.rundir import Run
from stages.evaluate.runner import EPISODES_FILE, evaluated_policy, output_path


def resolve_eval_target(
    run: Run, config: Config, checkpoint: str, iteration: int | None
) -> tuple[int, Path, str, Path]:
    """(iteration, model directory, checkpoint name, output path) of a ``graft eval`` call.

    ``--iter I`` / ``--checkpoint latest``: the run's checkpoint of I (or the newest) ->
    ``iter_I/eval.parquet``; ``initial``: the initial policy -> ``<run>/eval.parquet`` (iter -1);
    another directory: that model -> ``<run>/eval_<dirname>.parquet`` (iter -1).
    """
    if iteration is not None and iteration < -1:
        raise GraftError(f"eval: --iter must be >= 0 (or -1: the initial policy), got {iteration}")
    if iteration is None and checkpoint == "latest":
        latest = run.latest_checkpoint()
        if latest is None:
            raise GraftError(f"{run.root}: no complete checkpoint yet")
        iteration = int(latest.name[5:])
    if iteration is not None and iteration >= 0:
        model_dir = evaluated_policy(run, iteration, config)
        return iteration, model_dir, model_dir.name, output_path(run, iteration)
    if evaluates_initial_policy(checkpoint, iteration):  # named as the loop's evaluation of it
        return -1, evaluated_policy(run, -1, config), INITIAL_VERSION, output_path(run, -1)
    model_dir = Path(checkpoint)
    if checkpoint_complete(model_dir):
        verify_checkpoint(model_dir)
    elif not (model_dir / "config.json").is_file():
        raise GraftError(f"{model_dir}: not a checkpoint or model directory")
    name = model_dir.resolve().name
    out = run.root / f"eval_{name}.parquet"
    if out.name == EPISODES_FILE:  # its rows would take the place of the initial policy's episodes
        raise GraftError(f"{model_dir}: a checkpoint named '{name}' cannot be evaluated here; rename it")
    return -1, model_dir, name, out


def evaluates_initial_policy(checkpoint: str, iteration: int | None) -> bool:
    """Whether a ``graft eval`` call scores the run's initial policy (``--iter -1`` or
    ``--checkpoint initial``)."""
    return iteration == -1 or (iteration is None and checkpoint == INITIAL_VERSION)
