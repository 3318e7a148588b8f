"""The run's initial model is recorded like every checkpoint.

The models a run starts from -- its base (``model.path`` or its own tiny ``model/``) and its initial
policy (the warm start's ``sft/model`` when there is one) -- are the reference of every update's KL
term, the policy of iteration 0 and a LoRA run's base. ``record_initial_models`` (the loop and the
stage commands, under the run's lock, whenever they make or reuse them) records the size and sha256 of
every file of each in the run's ``manifest.json`` under ``models`` ({where: {file: entry}}; ``where``
relative to the run for a model inside it, else its absolute path); a model already recorded is
verified instead. ``verify_initial_model`` is what every reader calls before it loads one (``graft
eval --checkpoint initial``, ``graft export`` of a LoRA checkpoint, the update's reference): a flipped
byte, a missing or added file, or another model of the same shape in its place is one line naming the
file. A run from before this record has nothing to verify until a loop or stage command records it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.atomic import atomic_write_text
from schemas.config import Config
from schemas.definitions import INITIAL_VERSION
from schemas.errors import GraftError
from schemas.manifest import (
    MANIFEST_FILE,
    acting_checkpoint,
    ensure_run_manifest,
    refuse_lost_root_record,
    run_manifest,
    sha256,
)
from schemas.rundir import Run
from schemas.verified import known_intact

MODELS_KEY = "models"


def model_key(run: Run, folder: Path) -> str:
    """How the run's manifest names ``folder``: relative to the run inside it, else its absolute path."""
    resolved, root = folder.resolve(), run.root.resolve()
    return resolved.relative_to(root).as_posix() if root in resolved.parents else str(resolved)


def initial_models(run: Run, config: Config) -> list[Path]:
    """The base model and (when a warm start makes another) the initial policy of ``run``."""
    base, policy = run.base_model_dir(config), run.initial_policy_dir(config)
    return [base] if base.resolve() == policy.resolve() else [base, policy]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _damage(run: Run, folder: Path, recorded: dict[str, Any]) -> str | None:
    """How ``folder`` differs from its record (None: it does not), checksums cached by file identity."""
    check, commit = known_intact("model")
    where = "the run's manifest"
    fix = "restore the run's initial model (every iteration was computed from it)"
    for path in _files(folder):
        if path.relative_to(folder).as_posix() not in recorded:
            return f"{path}: not in {where} (added to the run's initial model); remove it, or {fix}"
    for name, entry in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            return f"{path}: listed in {where} but missing; {fix}"
        if not isinstance(entry, dict) or path.stat().st_size != entry.get("size"):
            return f"{path}: size differs from {where} (the initial model was replaced); {fix}"
        digest = str(entry.get("sha256"))
        if not check(path, digest) and sha256(path) != digest:
            return f"{path}: checksum differs from {where} (the initial model was changed or replaced); {fix}"
    commit()
    return None


def _recorded(run: Run, folder: Path) -> dict[str, Any] | None:
    data = run_manifest(run)
    models = data.get(MODELS_KEY) if data is not None else None
    record = models.get(model_key(run, folder)) if isinstance(models, dict) else None
    if record is not None and not isinstance(record, dict):
        raise GraftError(f"{run.root / MANIFEST_FILE}: its record of {folder} is not a table of files")
    return record


def verify_initial_model(run: Run, folder: Path, context: str = "") -> Path:
    """``folder`` when it is what the run's manifest records of it (or the run records nothing of it,
    a run from before the record); a GraftError naming the first differing file otherwise. A record
    that finished iterations were made with and that is gone is refused, not read as "from before"."""
    refuse_lost_root_record(run, context)
    record = _recorded(run, folder)
    if record is not None:
        damage = _damage(run, folder, record)
        if damage is not None:
            raise GraftError(damage + context)
    return folder


def verify_recorded_models(run: Run, context: str = "") -> None:
    """Every model the run's manifest records is what it recorded (``verify_initial_model``); for a
    caller without the run's config (a stage's ``--force`` before it removes anything)."""
    refuse_lost_root_record(run, context)
    data = run_manifest(run)
    models = data.get(MODELS_KEY) if data is not None else None
    for key in sorted(models) if isinstance(models, dict) else []:
        folder = Path(key) if Path(key).is_absolute() else run.root / key
        verify_initial_model(run, folder, context)


def record_initial_models(run: Run, config: Config) -> None:
    """Record the run's initial models in its manifest (a writer holding the run's lock); one recorded
    before is verified instead. A lost record is refused, never made again from the models there now."""
    refuse_lost_root_record(run)
    for folder in initial_models(run, config):
        if not folder.is_dir():
            continue
        if _recorded(run, folder) is not None:
            verify_initial_model(run, folder)
            continue
        entries = {
            p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)}
            for p in _files(folder)
        }
        data = ensure_run_manifest(run)
        models = data.get(MODELS_KEY) if isinstance(data.get(MODELS_KEY), dict) else {}
        data[MODELS_KEY] = {**models, model_key(run, folder): entries}
        atomic_write_text(run.root / MANIFEST_FILE, json.dumps(data, indent=2, sort_keys=True))


def verified_initial_policy(run: Run, config: Config) -> Path:
    """The run's initial policy -- the warm start's checkpoint, ``model.path`` or the run's own tiny
    model (``Run.initial_policy_dir``) -- verified against the run's manifest (``verify_initial_model``):
    the policy of iteration 0, the frozen reference of every update's KL term and the model an
    evaluation of iteration -1 scores."""
    return verify_initial_model(run, run.initial_policy_dir(config))


def acting_policy(run: Run, iteration: int, config: Config, stage: str) -> tuple[Path, str]:
    """The one answer to "which policy acts in (and is trained by) ``iteration``": (its directory, its
    ``policy_version``) -- the checkpoint of iteration - 1 (verified against its finished iteration;
    a missing one is an error), or in iteration 0 the run's initial policy (verified against the run's
    manifest), version ``INITIAL_VERSION``.

    It builds nothing: the initial policy (the tiny model, the warm start) is made before a stage that
    uses it runs (``stages.loop.stage.run_stage``, for the loop and the stage commands alike; ``graft
    sft``); a stage runner called on its own that finds none says which command makes it."""
    checkpoint = acting_checkpoint(run, iteration, stage)
    if checkpoint is not None:
        return checkpoint, checkpoint.name
    initial = run.initial_policy_dir(config)
    if not (initial / "config.json").is_file():
        made_by = f"graft sft {run.root}" if config.sft.enabled else f"graft loop --run {run.root}"
        raise GraftError(
            f"{stage} of iteration {iteration}: the run has no initial policy yet ({initial}); "
            f"`{made_by}` makes it (graft loop makes it before its first iteration)"
        )
    return verified_initial_policy(run, config), INITIAL_VERSION
