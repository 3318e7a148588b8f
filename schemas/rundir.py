"""The run directory (SPEC §8):

    runs/<name>/config.toml                resolved config the run is pinned to
    runs/<name>/iter_NNNN/<table>.parquet  the tables of iteration NNNN
    runs/<name>/checkpoints/iter_NNNN/     Hugging Face checkpoint written by update of NNNN
    runs/<name>/model/                     initial (reference) model when the run builds a tiny one

Every output is written to a temporary name and renamed, so a file that exists is complete. A stage
is complete when all of its outputs exist (``stage_complete``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from schemas import read_table, write_table
from schemas.config import Config, load_config
from schemas.errors import GraftError
from schemas.io import publish_mode

# Outputs of each stage, relative to iter_NNNN/ ("checkpoint" = checkpoints/iter_NNNN).
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "rollout": ("steps.parquet",),
    "graph": ("nodes.parquet", "edges.parquet"),
    "solve": ("values.parquet",),
    "advantage": ("advantages.parquet",),
    "update": ("update.parquet", "checkpoint"),
    "eval": ("eval.parquet",),
}
STAGES = ("rollout", "graph", "solve", "advantage", "update")


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
        return self.root / "model"

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

    def acting_checkpoint(self, iteration: int, stage: str) -> Path | None:
        """The checkpoint whose policy acts in (and is trained by) ``iteration``: that of iteration - 1,
        None for iteration 0 (the initial model).

        The policy after i updates plays iteration i; an older checkpoint would silently train on
        another policy's rollouts, so a missing one is a user error naming it.
        """
        if iteration <= 0:
            return None
        previous = self.checkpoint_dir(iteration - 1)
        if not checkpoint_complete(previous):
            raise GraftError(
                f"{stage} of iteration {iteration}: {previous} is not a complete checkpoint (iteration "
                f"{iteration} acts with the policy after {iteration} updates); run iteration {iteration - 1} "
                "first (graft loop resumes a run)"
            )
        return previous

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

    def read(self, iteration: int, table: str) -> pl.DataFrame:
        return read_table(self.table_path(iteration, table), table)

    def write(self, iteration: int, table: str, data: pl.DataFrame) -> Path:
        return write_table(data, table, self.table_path(iteration, table))

    def load_config(self, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        if not self.config_path.is_file():
            raise GraftError(f"{self.root}: not a graft run (no config.toml)")
        return load_config(self.config_path, overrides)


CHECKPOINT_MARKER = "graft_checkpoint.json"


def checkpoint_complete(path: Path) -> bool:
    """A checkpoint directory is complete when its marker file exists (written last, by rename)."""
    return (path / CHECKPOINT_MARKER).is_file()


def open_run(path: str | Path) -> Run:
    """Open an existing run directory or raise a GraftError naming it."""
    root = Path(path)
    if not root.is_dir():
        raise GraftError(f"{root}: run directory not found")
    if not (root / "config.toml").is_file():
        raise GraftError(f"{root}: not a graft run (no config.toml)")
    return Run(root)


def create_run(path: str | Path, config: Config, force: bool = False) -> Run:
    """Create a run directory pinned to ``config``, or reopen one with the same config.

    Reopening with a different resolved config is refused unless ``force`` (then the new config
    replaces the saved one).
    """
    run = Run(Path(path))
    run.root.mkdir(parents=True, exist_ok=True)
    text = config.to_toml()
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
    atomic_write_text(run.config_path, text)
    return run


def _config_diff(old: Config, new: Config) -> str:
    a, b = old.to_dict(), new.to_dict()
    changes = []
    for section in a:
        for key in a[section]:
            if a[section][key] != b[section].get(key):
                changes.append(f"{section}.{key}: {a[section][key]!r} -> {b[section][key]!r}")
    return "; ".join(changes[:4]) + (" ..." if len(changes) > 4 else "")


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_dir(final: Path) -> Path:
    """Return a fresh temporary sibling directory to fill, then ``commit_dir`` it to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    publish_mode(tmp, directory=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Move a filled temporary directory into place (replacing an incomplete ``final``).

    Files inside get the ordinary umask permissions first: libraries write some through their own
    temporary files (transformers' ``model.safetensors`` arrives 0600), and a checkpoint should be
    readable like any other output."""
    for path in tmp.rglob("*"):
        if path.is_file() and not path.is_symlink():
            publish_mode(path)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
