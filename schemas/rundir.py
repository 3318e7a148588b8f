"""The run directory (docs/design.md §8):

    runs/<name>/config.toml                resolved config the run is pinned to
    runs/<name>/iter_NNNN/<table>.parquet  the tables of iteration NNNN
    runs/<name>/checkpoints/iter_NNNN/     Hugging Face checkpoint written by update of NNNN
    runs/<name>/model/                     initial (reference) model when the run builds a tiny one

Every output is written to a temporary name and renamed, so a file that exists is complete. A stage
is complete when all of its outputs exist (``stage_complete``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from schemas import read_table, write_table
from schemas.atomic import atomic_write_text, remove_outputs
from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.integrity import checkpoint_complete, checkpoint_damage
from schemas.io import verify_table
from schemas.lock import LOCK_FILE
from schemas.stage_table import STAGE_TABLE
from schemas.trust import refuse_code_from_run, saved_runs_trusted

# Derived from the one table of stages (schemas/stage_table.py): every stage's name in order, the
# iteration's stages (the evaluation follows them when due), each stage's outputs relative to
# iter_NNNN/ ("checkpoint" = checkpoints/iter_NNNN), the other files it writes there, its short label.
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE)
STAGES: tuple[str, ...] = tuple(s.name for s in STAGE_TABLE if s.in_iteration)
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {s.name: s.outputs for s in STAGE_TABLE}
DERIVED_FILES: dict[str, tuple[str, ...]] = {s.name: s.derived_files for s in STAGE_TABLE}
STAGE_LABELS: dict[str, str] = {s.name: s.label for s in STAGE_TABLE}
# the loop's done-marker, its seconds sidecar and the finished iteration's manifest (removed together;
# schemas/manifest.py)
LOOP_FILES = ("metrics_loop.parquet", ".loop_seconds.json", "manifest.json")


@dataclass(frozen=True)
class Run:
    """A run directory."""

    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    def iter_dir(self, iteration: int) -> Path:
        return self.root / f"iter_{iteration:04d}"

    def table_path(self, iteration: int, table: str) -> Path:
        return self.iter_dir(iteration) / f"{table}.parquet"

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.root / "checkpoints" / f"iter_{iteration:04d}"

    @property
    def initial_eval_path(self) -> Path:
        """Evaluation of the initial policy (iter = -1), at the run root so `graft sql` reads it too."""
        return self.root / "eval.parquet"

    @property
    def initial_model_dir(self) -> Path:
        """The tiny model a run builds for itself when ``model.path`` is empty."""
        return self.root / "model"

    @property
    def sft_dir(self) -> Path:
        """The warm start's outputs (demos, losses, checkpoint)."""
        return self.root / "sft"

    @property
    def sft_model_dir(self) -> Path:
        return self.sft_dir / "model"

    @property
    def demos_path(self) -> Path:
        return self.sft_dir / "demos" / "steps.parquet"

    def base_model_dir(self, config: Config) -> Path:
        """The model the run starts from before any warm start: ``model.path`` or its own tiny model."""
        return Path(config.model.path) if config.model.path else self.initial_model_dir

    def initial_policy_dir(self, config: Config) -> Path:
        """The policy of iteration 0 and the frozen KL reference: the warm start's checkpoint when
        ``sft.enabled``, else the base model."""
        return self.sft_model_dir if config.sft.enabled else self.base_model_dir(config)

    def iterations(self) -> list[int]:
        """Iterations that have a directory, ascending."""
        out = []
        for child in self.root.glob("iter_*"):
            suffix = child.name[5:]
            if child.is_dir() and suffix.isdigit():
                out.append(int(suffix))
        return sorted(out)

    def latest_checkpoint(self, before: int | None = None) -> Path | None:
        """Newest complete checkpoint (optionally of an iteration < ``before``)."""
        best: tuple[int, Path] | None = None
        for child in (self.root / "checkpoints").glob("iter_*"):
            suffix = child.name[5:]
            if not suffix.isdigit() or not checkpoint_complete(child):
                continue
            it = int(suffix)
            if before is not None and it >= before:
                continue
            if best is None or it > best[0]:
                best = (it, child)
        return best[1] if best else None

    def output_paths(self, stage: str, iteration: int) -> list[Path]:
        paths = []
        for name in STAGE_OUTPUTS[stage]:
            if name == "checkpoint":
                paths.append(self.checkpoint_dir(iteration))
            else:
                paths.append(self.iter_dir(iteration) / name)
        return paths

    def stage_complete(self, stage: str, iteration: int) -> bool:
        """True when every output of ``stage`` for ``iteration`` exists (writes are atomic)."""
        for path in self.output_paths(stage, iteration):
            if path.suffix == ".parquet":
                if not path.is_file():
                    return False
            elif not checkpoint_complete(path):
                return False
        return True

    def dependent_outputs(self, stage: str, iteration: int) -> list[Path]:
        """Existing outputs computed from ``stage`` of ``iteration``, in the order to remove them.

        Within the iteration: the loop's done-marker, then the later stages newest first; after it,
        every later iteration (its rollout acts with a checkpoint trained on this one) newest first.
        Evaluation is a leaf: nothing depends on it. Removing in this order keeps the run a
        consistent prefix at every moment.
        """
        if stage == "eval" or iteration < 0:
            return []
        later_iters = [i for i in self.iterations() if i > iteration]
        later_ckpts = [i for i in self.checkpoint_iterations() if i > iteration]
        out: list[Path] = []
        for i in sorted(set(later_iters) | set(later_ckpts), reverse=True):
            out += [p for p in (self.iter_dir(i), self.checkpoint_dir(i)) if p.exists()]
        inside = [self.iter_dir(iteration) / name for name in LOOP_FILES]
        for later in reversed(STAGE_NAMES[STAGE_NAMES.index(stage) + 1 :]):
            inside += self.output_paths(later, iteration)
            inside += [self.iter_dir(iteration) / name for name in DERIVED_FILES[later]]
        return out + [p for p in inside if p.exists()]

    def checkpoint_iterations(self) -> list[int]:
        """Iterations that have a checkpoint directory (complete or not), ascending."""
        out = []
        for child in (self.root / "checkpoints").glob("iter_*"):
            suffix = child.name[5:]
            if child.is_dir() and suffix.isdigit():
                out.append(int(suffix))
        return sorted(out)

    def output_damage(self, stage: str, iteration: int) -> list[str]:
        """What is wrong with the existing outputs of ``stage`` (checksums, readability); [] = intact."""
        problems = []
        for path in self.output_paths(stage, iteration):
            if path.suffix == ".parquet":
                problem = verify_table(path) if path.is_file() else None
            else:
                problem = checkpoint_damage(path) if checkpoint_complete(path) else None
            if problem is not None:
                problems.append(problem)
        return problems

    def read(self, iteration: int, table: str) -> pl.DataFrame:
        return read_table(self.table_path(iteration, table), table)

    def write(self, iteration: int, table: str, data: pl.DataFrame) -> Path:
        return write_table(data, table, self.table_path(iteration, table))

    def saved_config(self) -> Config:
        """The run's config.toml as saved, for comparison only (nothing acts on it here); one edited
        since graft sealed it is refused (schemas.run_config)."""
        if not self.config_path.is_file():
            raise GraftError(f"{self.root}: not a graft run (no config.toml)")
        from schemas.run_config import refuse_config_edit  # it imports this module

        refuse_config_edit(self)
        return load_config(self.config_path)

    def load_config(self, overrides: list[str] | tuple[str, ...] = (), accept_edit: bool = False) -> Config:
        """The run's saved config with ``overrides``; settings in it that can run code must be
        repeated by ``overrides`` (or the process must trust saved runs: ``graft --trust-run``). A
        config.toml edited since graft sealed it is refused unless ``accept_edit`` (``graft loop
        --force``, which seals it)."""
        if not self.config_path.is_file():
            raise GraftError(f"{self.root}: not a graft run (no config.toml)")
        from schemas.run_config import refuse_config_edit  # it imports this module

        refuse_config_edit(self, accept=accept_edit)
        config = load_config(self.config_path, overrides)
        if not saved_runs_trusted():
            refuse_code_from_run(self.config_path, config, overrides)
        return config


def record_overrides(run: Run, iteration: int, stage: str, overrides: list[str] | tuple[str, ...]) -> None:
    """What a stage command ran with beyond config.toml: ``iter_NNNN/overrides_<stage>.json`` (the
    ``--set`` items, in order), so a run whose iteration 7 ran another estimator says so; none: no file."""
    path = run.iter_dir(iteration) / f"overrides_{stage}.json"
    if overrides:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"stage": stage, "set": list(overrides)}, indent=2))
    else:
        path.unlink(missing_ok=True)


def open_run(path: str | Path) -> Run:
    """Open an existing run directory or raise a GraftError naming it."""
    root = Path(path)
    if not root.is_dir():
        raise GraftError(f"{root}: run directory not found")
    if not (root / "config.toml").is_file():
        raise GraftError(f"{root}: not a graft run (no config.toml)")
    return Run(root)


@dataclass(frozen=True)
class StartSnapshot:
    """The folder a new run is starting in, as this start found it once it held the run's lock: whether
    the folder and its lock file were there before, and what else it held."""

    root: Path
    existed: bool
    had_lock: bool
    entries: frozenset[Path]


def start_snapshot(root: Path, existed: bool, had_lock: bool) -> StartSnapshot | None:
    """The state of ``root`` when a new run starts there, taken while holding the run's lock (so nothing
    another process wrote is taken for this start's own); ``existed`` / ``had_lock``: whether the folder
    and ``.lock`` were there before this process took the lock. None when a run (config.toml) is there."""
    if (root / "config.toml").is_file():
        return None
    entries = frozenset(p for p in root.iterdir() if had_lock or p.name != LOCK_FILE)
    return StartSnapshot(root, existed, had_lock, entries)


def discard_refused_start(snapshot: StartSnapshot | None) -> bool:
    """After the start of a new run was refused (a GraftError before any iteration wrote a table), still
    holding the run's lock: remove what the start wrote -- config.toml, a tiny model, an initial
    evaluation, then the lock file it created and the folder when it was new -- so the folder is as it
    was, and fixing the config needs no --force. True when something was removed.

    A folder made new is removed with ``rmdir`` after its own entries, never recursively: if another
    process put anything there since, it stays."""
    if snapshot is None or any(snapshot.root.glob("iter_*/*.parquet")):
        return False
    if not snapshot.root.is_dir():
        return False
    added = [p for p in snapshot.root.iterdir() if p not in snapshot.entries and p.name != LOCK_FILE]
    remove_outputs(added)
    if not snapshot.had_lock:
        (snapshot.root / LOCK_FILE).unlink(missing_ok=True)
    if not snapshot.existed:
        with contextlib.suppress(OSError):  # not empty: something another process wrote stays
            snapshot.root.rmdir()
    return bool(added)


def create_run(path: str | Path, config: Config, force: bool = False) -> Run:
    """Create a run directory pinned to ``config``, or reopen one with the same config.

    Reopening with a different resolved config is refused unless ``force`` (then the new config
    replaces the saved one).
    """
    run = Run(Path(path))
    run.root.mkdir(parents=True, exist_ok=True)
    if run.config_path.is_file():
        saved = load_config(run.config_path)
        if saved != config and not force:
            diff = _config_diff(saved, config)
            raise GraftError(
                f"{run.config_path}: run was started with a different config ({diff}); "
                "use --force to continue with the new one"
            )
        if saved == config:
            return run
    from schemas.run_config import write_run_config  # it imports this module

    write_run_config(run, config)  # written and sealed in the run's manifest
    return run


def _config_diff(old: Config, new: Config) -> str:
    a, b = old.to_dict(), new.to_dict()
    changes = []
    for section in a:
        for key in a[section]:
            if a[section][key] != b[section].get(key):
                changes.append(f"{section}.{key}: {a[section][key]!r} -> {b[section][key]!r}")
    return "; ".join(changes[:4]) + (" ..." if len(changes) > 4 else "")
