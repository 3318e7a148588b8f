"""A finished iteration is its manifest.

When the loop finishes an iteration it checks the iteration's tables against each other
(``cross_check``: row counts, row keys, iteration numbers) and then writes ``iter_NNNN/manifest.json``:
the size and sha256 of every file of the iteration (the tables, ``eval.parquet`` included, the stage
commands' ``overrides_*.json`` and the done-marker ``metrics_loop.parquet``) and the checksums of its
checkpoint (the files ``checkpoints/iter_NNNN/graft_checkpoint.json`` lists, plus the rest of that
marker). Every reader of a finished iteration (``graft sql``, ``eval``, ``report``, ``export``,
``viz``, the loop on resume, the stage commands) calls ``verify_finished`` first, which refuses any
difference with one line naming the file and the command that recomputes it.

Checkpoint retention may remove a finished iteration's checkpoint, or its ``trainer_state/`` (the
optimizer moments), so those may be missing; what is there must be what was recorded.

The run's own manifest (``<run>/manifest.json``) records the tables at the top of the run (the
initial policy's ``eval.parquet`` and ``eval_<name>.parquet`` of ``graft eval --checkpoint DIR``)
and ``iterations_from``, the first iteration the run records a manifest for: from there on, a
finished iteration without its manifest is damage, not a run from before manifests. Each iteration's
manifest records its own number (``iteration``; a checkpoint marker does too) and repeats
``iterations_from``: a finished iteration copied over another is refused, and deleting the run's
manifest does not excuse a manifest-less iteration. Manifests from before these fields have nothing
to compare.

Files that replace a recorded one after the iteration finished (``graft eval --force``) are written
under a temporary name, recorded, then renamed (``publish_recorded``): a kill in between leaves a
manifest naming a missing file, never an unrecorded file.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from schemas import read_table, write_table
from schemas.atomic import atomic_write_text
from schemas.confine import refuse_links_inside
from schemas.errors import GraftError
from schemas.integrity import (
    CHECKPOINT_MARKER,
    MARKER_FILES_KEY,
    checkpoint_complete,
    checkpoint_damage,
    file_digests,
)
from schemas.jsonfile import load_json
from schemas.rundir import DERIVED_FILES, STAGE_OUTPUTS, Run
from schemas.verified import known_intact, refuse_cache_inside

MANIFEST_FILE = "manifest.json"
DONE_MARKER = "metrics_loop.parquet"  # written last by the loop: its presence marks a finished iteration
MANIFEST_VERSION = 2
# what a version-1 manifest (before eval tables and checkpoints were recorded) left out
_V1_EXCLUDED = ("metrics_loop.parquet", "eval.parquet")
_OPTIMIZER_STATE = "trainer_state/"  # retention may drop it from a kept checkpoint
ROOT_TABLES = ("eval.parquet", "eval_*.parquet")  # the tables at the top of a run the run's manifest records

Check = Callable[[Path, str], bool]


@dataclass(frozen=True)
class Damage:
    """A file of a finished iteration that is not what was recorded, and the stage that writes it
    (None: no stage does; "eval": graft eval; "rollout" for the iteration as a whole)."""

    path: Path
    what: str
    stage: str | None


def iteration_finished(run: Run, iteration: int) -> bool:
    return (run.iter_dir(iteration) / DONE_MARKER).is_file()


def sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256(path)}


def recorded_files(folder: Path) -> list[Path]:
    """The files of an iteration a manifest records: its tables and JSON files, not hidden ones."""
    return sorted(p for p in folder.iterdir() if _recorded(p))


def _recorded(path: Path) -> bool:
    return (
        path.is_file()
        and path.suffix in (".parquet", ".json")
        and not path.name.startswith(".")
        and path.name != MANIFEST_FILE
    )


def producing_stage(name: str) -> str | None:
    """The stage whose (re)computation writes the iteration file ``name``."""
    for stage, outputs in STAGE_OUTPUTS.items():
        if name in outputs:
            return stage
    for stage, derived in DERIVED_FILES.items():
        if name in derived:
            return stage
    if name.startswith(("steps.shard-", "metrics_rollout.shard-")) or name in (DONE_MARKER, MANIFEST_FILE):
        return "rollout"  # the iteration as a whole
    return None


def remedy(run: Run, iteration: int, damage: Damage) -> str:
    """What to run about ``damage`` (one clause)."""
    root = run.root
    if damage.stage is None:
        return "remove it (no stage writes it), or restore the iteration"
    if damage.stage == "eval":
        where = "--iter -1" if iteration < 0 else f"--iter {iteration}"
        if damage.path.name.startswith("eval_") and damage.path.name not in DERIVED_FILES["eval"]:
            return f"remove it, or evaluate again: graft eval {root} --checkpoint DIR --force"
        return f"restore the file, or evaluate again: graft eval {root} {where} --force"
    return (
        f"restore the file, or recompute it: graft {damage.stage} {root} --iter {iteration} --force, "
        f"then graft loop --run {root}"
    )


def describe(run: Run, iteration: int, damage: Damage) -> str:
    """The one line a reader refuses ``damage`` with."""
    return f"{damage.path}: {damage.what}; {remedy(run, iteration, damage)}"


# ---------------------------------------------------------------------------------------------
# checkpoints


def checkpoint_record(path: Path) -> dict[str, Any] | None:
    """What a manifest records of a complete checkpoint: the checksums its marker lists (hashed here
    for a checkpoint from before markers had them) and the rest of the marker."""
    if not checkpoint_complete(path):
        return None
    marker = _read_marker(path)
    if marker is None:
        raise GraftError(f"{path / CHECKPOINT_MARKER}: unreadable checkpoint marker")
    files = marker.get(MARKER_FILES_KEY)
    if not isinstance(files, dict):
        files = file_digests(path)
    return {"files": files, "marker": {k: v for k, v in marker.items() if k != MARKER_FILES_KEY}}


def _marker_number(path: Path, marker: dict[str, Any]) -> Damage | None:
    """The marker of run checkpoint ``checkpoints/iter_NNNN`` must record iteration NNNN."""
    suffix = path.name[5:]
    if not (path.name.startswith("iter_") and suffix.isdigit()):
        return None
    damage = number_damage(path / CHECKPOINT_MARKER, marker.get("iteration"), int(suffix), "a checkpoint")
    return None if damage is None else Damage(damage.path, damage.what, "update")


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = load_json(path / CHECKPOINT_MARKER)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def checkpoint_mismatch(path: Path, recorded: dict[str, Any]) -> Damage | None:
    """How the checkpoint at ``path`` differs from what a manifest ``recorded`` (None: it does not):
    its marker's checksums and the rest of its marker are compared, its files are not hashed here
    (``verify_checkpoint_read`` does that for a reader of the weights).

    Missing (retention pruned it) or without its optimizer state: not a difference."""
    if not path.exists():
        return None
    if not checkpoint_complete(path):
        return Damage(path, f"incomplete checkpoint (no {CHECKPOINT_MARKER})", "update")
    marker = _read_marker(path)
    if marker is None:
        return Damage(path / CHECKPOINT_MARKER, "unreadable checkpoint marker", "update")
    files = marker.get(MARKER_FILES_KEY)
    if not isinstance(files, dict):
        files = file_digests(path)  # a checkpoint without checksums: hashed here
    wrong = _marker_number(path, marker)
    if wrong is not None:
        return wrong
    rest = {k: v for k, v in marker.items() if k != MARKER_FILES_KEY}
    if rest != recorded.get("marker", rest):
        return Damage(path / CHECKPOINT_MARKER, "differs from the finished iteration's manifest", "update")
    want = recorded.get("files")
    if not isinstance(want, dict):
        return None
    for name in sorted(set(files) - set(want)):
        return Damage(
            path / name, "not in the finished iteration's manifest (added to the checkpoint)", "update"
        )
    for name, digest in sorted(want.items()):
        if name not in files:
            if name.startswith(_OPTIMIZER_STATE):
                continue  # dropped by retention
            return Damage(path / name, "listed in the finished iteration's manifest but missing", "update")
        if files[name] != digest:
            return Damage(
                path / name, "differs from the finished iteration's manifest (another checkpoint)", "update"
            )
    return None


# ---------------------------------------------------------------------------------------------
# the run's manifest


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = load_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_manifest(run: Run) -> dict[str, Any] | None:
    """``<run>/manifest.json`` (None: a run from before manifests, or not a run)."""
    path = run.root / MANIFEST_FILE
    if not path.is_file():
        return None
    data = _read_json(path)
    if data is None or not isinstance(data.get("files", {}), dict):
        raise GraftError(f"{path}: unreadable run manifest; restore it (or remove it to stop checking)")
    return data


ROOT_RECORD_KEY = "root"  # an iteration manifest's list of the run manifest's records it was made with
# the run's initial models (schemas.initial_model), its sealed config (schemas.run_config), its identity
ROOT_RECORDS = ("models", "config", "run_id", "finished")
RUN_ID_KEY = "run_id"  # a random identity of the run, repeated by each iteration's manifest
# the iterations the loop finished (added after the done-marker is in place, dropped by --force before
# it removes one): a finished iteration deleted or replaced by a link is refused, not read as never run
FINISHED_KEY = "finished"


def recorded_finished(run: Run) -> list[int]:
    data = run_manifest(run)
    listed = data.get(FINISHED_KEY) if data is not None else None
    return sorted(i for i in listed if isinstance(i, int)) if isinstance(listed, list) else []


def _write_finished(run: Run, iterations: set[int]) -> None:
    data = ensure_run_manifest(run)
    if data.get(FINISHED_KEY) != sorted(iterations):
        data[FINISHED_KEY] = sorted(iterations)
        atomic_write_text(run.root / MANIFEST_FILE, json.dumps(data, indent=2, sort_keys=True))


def forget_finished(run: Run, from_iteration: int) -> None:
    """Before ``--force`` removes the done-marker of ``from_iteration`` or later ones: they leave the
    run's record of finished iterations first (a kill in between leaves finished iterations that are
    not recorded, which is fine; never recorded ones that are gone)."""
    if run_manifest(run) is not None and FINISHED_KEY in (run_manifest(run) or {}):
        _write_finished(run, {i for i in recorded_finished(run) if i < from_iteration})


def missing_finished_damage(run: Run) -> Damage | None:
    """A finished iteration the run's manifest records whose folder is gone, is a link, or lost its
    done-marker."""
    for i in recorded_finished(run):
        folder = run.iter_dir(i)
        if folder.is_symlink() or not (folder / DONE_MARKER).is_file():
            what = "a symlink" if folder.is_symlink() else "missing"
            return Damage(
                folder / DONE_MARKER,
                f"{what}, but the run's manifest records iteration {i} as finished",
                "rollout",
            )
    return None


def root_record_damage(run: Run) -> Damage | None:
    """The run's manifest, or one of its records (``models``, ``config``), missing while a finished
    iteration's manifest says it was made with it (its ``root`` list): the run's root record is lost
    (deleted, or the key removed). Refused like any damage, never recreated from what is there now
    (a swapped initial model would be recorded as the run's own)."""
    needed: set[str] = set()
    for i in run.iterations():
        if not (run.iter_dir(i) / MANIFEST_FILE).is_file():
            continue
        manifest = load_manifest(run.iter_dir(i))
        listed = manifest.get(ROOT_RECORD_KEY) if manifest is not None else None
        if isinstance(listed, list):
            needed |= {str(key) for key in listed}
    if not needed:
        return None
    path = run.root / MANIFEST_FILE
    data = run_manifest(run)
    if data is None:
        return Damage(path, "missing, but the run's finished iterations were recorded with it", None)
    lost = sorted(key for key in needed if key not in data)
    if lost:
        return Damage(
            path, f"has lost its record of {', '.join(repr(k) for k in lost)}, which the run's finished "
            "iterations were recorded with", None,
        )  # fmt: skip
    return None


def refuse_lost_root_record(run: Run, context: str = "") -> None:
    """GraftError (one line) when ``root_record_damage`` finds the run's root record lost."""
    damage = root_record_damage(run)
    if damage is not None:
        raise GraftError(
            f"{damage.path}: {damage.what}; restore it (nothing in the run can be checked without it), "
            f"or start a new run{context}"
        )


def ensure_run_manifest(run: Run) -> dict[str, Any]:
    """The run's manifest, created when missing: iterations from the one after the last finished
    iteration without a manifest (a run from before manifests) on record one; the tables at the top of
    the run are recorded as they are. A manifest that finished iterations were recorded with is never
    recreated (``refuse_lost_root_record``)."""
    data = run_manifest(run)
    if data is not None:
        return data
    refuse_lost_root_record(run)
    unrecorded = [
        i
        for i in run.iterations()
        if iteration_finished(run, i) and not (run.iter_dir(i) / MANIFEST_FILE).is_file()
    ]
    # iterations' manifests repeat the rule of a lost run manifest: it is not relaxed by recreating it
    repeated = recorded_starts(
        run, [i for i in run.iterations() if (run.iter_dir(i) / MANIFEST_FILE).is_file()]
    )
    data = {
        "version": MANIFEST_VERSION,
        RUN_ID_KEY: uuid.uuid4().hex,
        "iterations_from": min([max(unrecorded) + 1 if unrecorded else 0, *repeated]),
        "files": {p.name: _entry(p) for p in _root_tables(run)},  # as they are: from before manifests
    }
    atomic_write_text(run.root / MANIFEST_FILE, json.dumps(data, indent=2, sort_keys=True))
    return data


def _root_tables(run: Run) -> list[Path]:
    return sorted({p for pattern in ROOT_TABLES for p in run.root.glob(pattern) if p.is_file()})


def root_damage(run: Run, check: Check, skip: Iterable[str] = ()) -> Damage | None:
    """A table at the top of the run that differs from the run's manifest (missing ones are fine:
    not yet evaluated); ``skip``: names the caller is about to replace."""
    data = run_manifest(run)
    if data is None:
        return None
    files = data.get("files", {})
    for path in _root_tables(run):
        if path.name in skip:
            continue
        entry = files.get(path.name)
        if not isinstance(entry, dict):
            return Damage(path, "not in the run's manifest (added after it was evaluated)", "eval")
        damage = _file_mismatch(path, entry, check, "the run's manifest", "eval")
        if damage is not None:
            return damage
    return None


# ---------------------------------------------------------------------------------------------
# iterations


def _file_mismatch(path: Path, entry: Any, check: Check, where: str, stage: str | None) -> Damage | None:
    if not isinstance(entry, dict) or path.stat().st_size != entry.get("size"):
        return Damage(path, f"size differs from {where} (the file was replaced)", stage)
    digest = str(entry.get("sha256"))
    if check(path, digest):
        return None
    if sha256(path) != digest:
        return Damage(path, f"checksum differs from {where} (changed or damaged)", stage)
    return None


class Expectation:
    """Which finished iterations of a run must have a manifest: from the run manifest's
    ``iterations_from`` on, and every one after an iteration that has one."""

    def __init__(self, run: Run) -> None:
        data = run_manifest(run)
        starts = [int(data.get("iterations_from", 0))] if data is not None else []
        recorded = [i for i in run.iterations() if (run.iter_dir(i) / MANIFEST_FILE).is_file()]
        # an iteration's own manifest repeats the run's iterations_from: the rule survives the loss of
        # the run's manifest
        starts += recorded_starts(run, recorded)
        self.start = min(starts) if starts else None
        self.first_recorded = min(recorded) if recorded else None

    def expected(self, iteration: int) -> bool:
        return (self.start is not None and iteration >= self.start) or (
            self.first_recorded is not None and iteration > self.first_recorded
        )


def recorded_starts(run: Run, iterations: Iterable[int]) -> list[int]:
    """The ``iterations_from`` the manifests of ``iterations`` repeat (manifests before it: none)."""
    out = []
    for i in iterations:
        manifest = load_manifest(run.iter_dir(i))
        start = manifest.get("iterations_from") if manifest is not None else None
        if isinstance(start, int) and not isinstance(start, bool):
            out.append(start)
    return out


def number_damage(path: Path, recorded: Any, iteration: int, what: str) -> Damage | None:
    """A manifest or checkpoint marker at ``path`` that records another iteration than ``iteration``
    (a finished iteration copied or renamed over another); None when it records none (older ones)."""
    if recorded is None or recorded == iteration:
        return None
    return Damage(
        path, f"records iteration {recorded!r}, not {iteration} ({what} copied or renamed)", "rollout"
    )


def run_identity(run: Run) -> str | None:
    data = run_manifest(run)
    value = data.get(RUN_ID_KEY) if data is not None else None
    return value if isinstance(value, str) else None


def other_run_damage(run: Run, path: Path, manifest: dict[str, Any]) -> Damage | None:
    """An iteration's manifest that records another run's identity than the run's manifest (a
    finished iteration copied from another run, consistent in itself); None when either records none
    (manifests from before the identity)."""
    theirs, ours = manifest.get(RUN_ID_KEY), run_identity(run)
    if theirs is None or ours is None or theirs == ours:
        return None
    return Damage(
        path, f"records another run ({RUN_ID_KEY} {str(theirs)[:12]}, this run's is {ours[:12]}): the "
        "iteration was copied from another run", "rollout",
    )  # fmt: skip


def load_manifest(folder: Path) -> dict[str, Any] | None:
    """An iteration's manifest, or None when it cannot be read."""
    data = _read_json(folder / MANIFEST_FILE)
    if data is None or not isinstance(data.get("files"), dict):
        return None
    return data


def iteration_damage(
    run: Run,
    iteration: int,
    check: Check,
    expectation: Expectation,
    *,
    skip: Iterable[str] = (),
) -> Damage | None:
    """The first file of finished ``iteration`` that differs from its manifest (None: all intact, or
    the iteration is not finished). ``skip``: file names the caller is about to replace.

    An unfinished iteration that still has a manifest (a kill between it and the done-marker, or while
    ``--force`` removed them) holds, of the files it lists, only what the manifest records."""
    folder = run.iter_dir(iteration)
    target = folder / MANIFEST_FILE
    if not iteration_finished(run, iteration):
        leftover = load_manifest(folder) if target.is_file() else None
        if leftover is None or leftover.get("version", 1) < MANIFEST_VERSION:
            return None
        wrong = number_damage(target, leftover.get("iteration"), iteration, "another iteration's manifest")
        wrong = wrong or other_run_damage(run, target, leftover)
        if wrong is not None:
            return wrong
        for name, entry in sorted(leftover["files"].items()):
            path = folder / name
            if name not in skip and path.is_file():
                damage = _file_mismatch(path, entry, check, "the iteration's manifest", producing_stage(name))
                if damage is not None:
                    return damage
        return None
    if not target.is_file():
        if expectation.expected(iteration):
            return Damage(target, "missing: a finished iteration without its manifest", "rollout")
        return None  # an iteration finished before manifests
    manifest = load_manifest(folder)
    if manifest is None:
        return Damage(target, "unreadable manifest", "rollout")
    wrong = number_damage(target, manifest.get("iteration"), iteration, "another iteration's manifest")
    wrong = wrong or other_run_damage(run, target, manifest)
    if wrong is not None:
        return wrong
    version = manifest.get("version", 1)
    files: dict[str, Any] = manifest["files"]
    skipped = set(skip) | (set(_V1_EXCLUDED) if version == 1 else set())
    present = {p.name for p in recorded_files(folder)} - skipped
    if version == 1:
        present = {n for n in present if n.endswith(".parquet")}
    for name in sorted(present - set(files)):
        return Damage(
            folder / name, "not in the finished iteration's manifest (added after it finished)", None
        )
    where = "the finished iteration's manifest"
    for name, entry in sorted(files.items()):
        if name in skipped:
            continue
        path = folder / name
        if not path.is_file():
            return Damage(path, f"listed in {where} but missing", producing_stage(name))
        damage = _file_mismatch(path, entry, check, where, producing_stage(name))
        if damage is not None:
            return damage
    recorded = manifest.get("checkpoint")
    if version >= 2 and isinstance(recorded, dict) and "checkpoint" not in skipped:
        return checkpoint_mismatch(run.checkpoint_dir(iteration), recorded)
    return None


def verify_finished(
    run: Run,
    iterations: Iterable[int] | None = None,
    *,
    skip: dict[int, Iterable[str]] | None = None,
    root: bool = True,
    context: str = "",
) -> None:
    """Refuse (one GraftError line naming the file and what to run) when a finished iteration of
    ``iterations`` (default: all) differs from its manifest, or (``root``) a table at the top of the
    run from the run's manifest; ``skip``: {iteration (-1: the top of the run): file names the caller
    is about to replace}. Files unchanged since they last verified against the same checksum
    are not hashed again (schemas.verified)."""
    refuse_cache_inside(run.root)  # before the cache is read or written
    refuse_lost_root_record(run, context)
    gone = missing_finished_damage(run)
    if gone is not None:
        raise GraftError(describe(run, int(gone.path.parent.name[5:]), gone) + context)
    check, commit = known_intact("manifest")
    expectation = Expectation(run)
    skip = skip or {}
    for iteration in run.iterations() if iterations is None else iterations:
        damage = iteration_damage(run, iteration, check, expectation, skip=skip.get(iteration, ()))
        if damage is not None:
            raise GraftError(describe(run, iteration, damage) + context)
    if root:
        damage = root_damage(run, check, skip.get(-1, ()))
        if damage is not None:
            raise GraftError(describe(run, -1, damage) + context)
    commit()


def verify_checkpoint_read(run: Run, iteration: int, context: str = "", skip: Iterable[str] = ()) -> Path:
    """Before the checkpoint of ``iteration`` is read: its finished iteration is what was recorded (but
    ``skip``, files the caller replaces), and every file of the checkpoint matches its marker's
    checksums; returns its path."""
    verify_finished(run, [iteration], skip={iteration: skip}, root=False, context=context)
    path = run.checkpoint_dir(iteration)
    if not checkpoint_complete(path):
        raise GraftError(f"{path}: not a complete checkpoint (no {CHECKPOINT_MARKER}){context}")
    marker = _read_marker(path)
    wrong = _marker_number(path, marker) if marker is not None else None
    if wrong is not None:
        raise GraftError(describe(run, iteration, wrong) + context)
    damage = checkpoint_damage(path)
    if damage is not None:
        fix = remedy(run, iteration, Damage(path, "", "update"))
        raise GraftError(f"{damage}; {fix}{context}")
    return path


def acting_checkpoint(run: Run, iteration: int, stage: str) -> Path | None:
    """The checkpoint whose policy acts in (and is trained by) ``iteration``: that of iteration - 1,
    None for iteration 0 (the initial model).

    The policy after i updates plays iteration i; an older checkpoint would silently train on
    another policy's rollouts, so a missing one is a user error naming it.
    """
    if iteration <= 0:
        return None
    previous = run.checkpoint_dir(iteration - 1)
    if not checkpoint_complete(previous):
        raise GraftError(
            f"{stage} of iteration {iteration}: {previous} is not a complete checkpoint (iteration "
            f"{iteration} acts with the policy after {iteration} updates); run iteration {iteration - 1} "
            "first (graft loop resumes a run)"
        )
    verify_checkpoint_read(run, iteration - 1)
    return previous


# ---------------------------------------------------------------------------------------------
# tables against each other


KEYS = ["group_id", "traj_id", "step"]
_PER_STEP = ("edges", "advantages")  # one row per steps row, in the same order


def _read(run: Run, iteration: int, table: str, file: str | None = None) -> pl.DataFrame | None:
    path = run.iter_dir(iteration) / (file or f"{table}.parquet")
    return read_table(path, table) if path.is_file() else None


def cross_check(
    run: Run, iteration: int, tables: Iterable[str] | None = None, *, iterations: bool = False
) -> None:
    """Refuse (GraftError naming the file) when the existing tables of ``iteration`` (or only
    ``tables``) disagree: edges and advantages must hold the steps rows' keys in the steps order (and
    edges their rewards), edges must name nodes that exist, values every node once, the update's
    reference log-probs steps rows only; with ``iterations`` every ``iter`` column must be
    ``iteration``. Reading them also verifies their page checksums."""
    wanted = (
        set(tables)
        if tables is not None
        else {"steps", "nodes", "edges", "values", "advantages", "reflogprobs"}
    )
    folder = run.iter_dir(iteration)
    loaded = {t: _read(run, iteration, t) for t in sorted(wanted)}
    steps = loaded.get("steps")
    root = run.root
    for table in _PER_STEP:
        frame = loaded.get(table)
        if steps is None or frame is None:
            continue
        path = folder / f"{table}.parquet"
        stage = "graph" if table == "edges" else "advantage"
        fix = f"recompute it from steps.parquet: graft {stage} {root} --iter {iteration} --force"
        if frame.height != steps.height:
            raise _fail(path, f"has {frame.height} rows but steps.parquet has {steps.height}", fix)
        differ = (frame.select(KEYS) != steps.select(KEYS)).select(pl.any_horizontal(pl.all())).to_series()
        if differ.any():
            row = int(differ.arg_max())  # type: ignore[arg-type]
            raise _fail(path, f"row {row} is not steps.parquet's row {row} (group_id, traj_id, step)", fix)
        if table == "edges" and not frame["reward"].equals(steps["reward"]):
            raise _fail(path, "its rewards are not steps.parquet's", fix)
    nodes, edges, values = loaded.get("nodes"), loaded.get("edges"), loaded.get("values")
    if nodes is not None:
        node_path = folder / "nodes.parquet"
        fix = f"recompute the graph: graft graph {root} --iter {iteration} --force"
        if nodes.select("group_id", "node").is_duplicated().any():
            raise _fail(node_path, "a (group_id, node) appears twice", fix)
        if edges is not None:
            known = nodes.select("group_id", "node")
            for end in ("src", "dst"):
                ends = edges.select("group_id", pl.col(end).alias("node")).unique()
                if ends.join(known, on=["group_id", "node"], how="anti").height:
                    raise _fail(folder / "edges.parquet", f"names {end} nodes that nodes.parquet lacks", fix)
        if values is not None:
            fix = f"recompute the values: graft solve {root} --iter {iteration} --force"
            keys = values.select("group_id", "node")
            if keys.height != nodes.height or keys.join(nodes, on=["group_id", "node"], how="anti").height:
                raise _fail(
                    folder / "values.parquet", "its (group_id, node) rows are not nodes.parquet's", fix
                )
    ref = loaded.get("reflogprobs")
    if (
        ref is not None
        and steps is not None
        and ref.select(KEYS).join(steps.select(KEYS), on=KEYS, how="anti").height
    ):
        fix = f"recompute the update: graft update {root} --iter {iteration} --force"
        raise _fail(folder / "reflogprobs.parquet", "holds rows steps.parquet does not", fix)
    if iterations:
        _check_iter_columns(run, iteration, steps)


def _fail(path: Path, what: str, fix: str) -> GraftError:
    return GraftError(
        f"{path}: {what}; the iteration's tables are not one history ({fix}, or restore the file)"
    )


def _check_iter_columns(run: Run, iteration: int, steps: pl.DataFrame | None) -> None:
    folder = run.iter_dir(iteration)
    frames: list[tuple[Path, pl.DataFrame]] = []
    if steps is not None:
        frames.append((folder / "steps.parquet", steps))
    for path in sorted(folder.glob("metrics_*.parquet")):
        frames.append((path, read_table(path, "metrics")))
    for name, table in (("update.parquet", "update"), ("eval.parquet", "eval")):
        if (folder / name).is_file():
            frames.append((folder / name, read_table(folder / name, table)))
    for path, frame in frames:
        others = frame.filter(pl.col("iter") != iteration)["iter"]
        if others.len():
            stage = producing_stage(path.name) or "rollout"
            fix = remedy(run, iteration, Damage(path, "", stage))
            raise GraftError(f"{path}: holds rows of iteration {others[0]}, not {iteration}; {fix}")


# ---------------------------------------------------------------------------------------------
# writing


def write_manifest(run: Run, iteration: int, done: Path | None = None, fresh: Iterable[str] = ()) -> Path:
    """Check the iteration's outputs against each other, then record them (``manifest.json``,
    atomic). ``done``: the loop's done-marker, written under a temporary name, recorded as
    ``metrics_loop.parquet`` before the caller renames it into place. An earlier manifest of the
    unfinished iteration (left by a kill between it and the done-marker, or by a done-marker removed
    since) must agree with the files it lists that are still there, but for ``fresh``: the files the
    caller has just written."""
    folder = run.iter_dir(iteration)
    cross_check(run, iteration, iterations=True)
    checkpoint = run.checkpoint_dir(iteration)
    if checkpoint_complete(checkpoint):
        damage = checkpoint_damage(checkpoint)
        if damage is not None:
            raise GraftError(f"{damage}; recompute it: graft update {run.root} --iter {iteration} --force")
    earlier = load_manifest(folder)
    files = {p.name: _entry(p) for p in recorded_files(folder)}
    if earlier is not None and earlier.get("version") == MANIFEST_VERSION:
        for name, entry in sorted(files.items()):
            old = earlier["files"].get(name)
            if old is not None and old != entry and name not in fresh:
                damage = Damage(
                    folder / name, "differs from the iteration's earlier manifest", producing_stage(name)
                )
                raise GraftError(describe(run, iteration, damage))
    if done is not None:
        files[DONE_MARKER] = _entry(done)
    root_manifest = ensure_run_manifest(run)
    if RUN_ID_KEY not in root_manifest:  # a run from before the identity gets one now
        root_manifest[RUN_ID_KEY] = uuid.uuid4().hex
        atomic_write_text(run.root / MANIFEST_FILE, json.dumps(root_manifest, indent=2, sort_keys=True))
    start = root_manifest.get("iterations_from", 0)
    data = {
        RUN_ID_KEY: root_manifest[RUN_ID_KEY],
        ROOT_RECORD_KEY: [key for key in ROOT_RECORDS if key in root_manifest],
        "version": MANIFEST_VERSION,
        "iteration": iteration,  # a copy of the iteration under another number is refused
        "iterations_from": start,  # the run manifest's rule, kept should that manifest be lost
        "files": files,
        "checkpoint": checkpoint_record(checkpoint),
    }
    target = folder / MANIFEST_FILE
    atomic_write_text(target, json.dumps(data, indent=2, sort_keys=True))
    return target


def forget_rewritten(run: Run, iteration: int, names: Iterable[str]) -> None:
    """Before the loop runs a stage of an unfinished iteration again: the manifest a kill or a removed
    done-marker left stops listing the files that stage writes (``names``), so the stage's own new
    outputs are not refused as changed by the checks until the iteration is recorded again."""
    folder = run.iter_dir(iteration)
    if iteration_finished(run, iteration) or not (folder / MANIFEST_FILE).is_file():
        return
    manifest = load_manifest(folder)
    if manifest is None:
        return
    kept = {name: entry for name, entry in manifest["files"].items() if name not in set(names)}
    if kept != manifest["files"]:
        manifest["files"] = kept
        atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))


def finish_iteration(run: Run, iteration: int, loop_rows: pl.DataFrame, fresh: Iterable[str] = ()) -> None:
    """Record the iteration (``write_manifest``) and write its done-marker (``metrics_loop.parquet``)
    last."""
    folder = run.iter_dir(iteration)
    pending = folder / f".{DONE_MARKER}.pending.tmp"  # a leftover is removed like any temporary
    write_table(loop_rows, "metrics", pending)
    try:
        write_manifest(run, iteration, done=pending, fresh=fresh)
        refuse_links_inside(pending)  # the folder is still no link (schemas.confine)
        os.replace(pending, folder / DONE_MARKER)
        _write_finished(run, {*recorded_finished(run), iteration})
    except BaseException:
        pending.unlink(missing_ok=True)
        raise


def record_file(run: Run, final: Path, source: Path | None = None) -> None:
    """Record ``source`` (default ``final``) as ``final`` in the manifest that covers ``final``: that of
    its finished iteration, or the run's for a table at its top (nothing for an unfinished iteration,
    whose manifest is written when it finishes)."""
    entry = _entry(source if source is not None else final)
    folder = final.parent
    if folder.resolve() == run.root.resolve():
        data = ensure_run_manifest(run)
        if data.get("files", {}).get(final.name) != entry:
            data["files"] = {**data.get("files", {}), final.name: entry}
            atomic_write_text(run.root / MANIFEST_FILE, json.dumps(data, indent=2, sort_keys=True))
    elif folder.name.startswith("iter_") and (folder / DONE_MARKER).is_file():
        manifest = load_manifest(folder)
        if manifest is not None and manifest.get("version", 1) >= MANIFEST_VERSION:
            manifest["files"][final.name] = entry
            atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))


def publish_recorded(run: Run, final: Path, pending: Path) -> Path:
    """Move ``pending`` (a complete file) to ``final``, recording it first (``record_file``): a kill
    in between leaves a recorded file that is missing, never an unrecorded one."""
    record_file(run, final, pending)
    refuse_links_inside(pending)  # the folder is still no link (schemas.confine)
    os.replace(pending, final)
    return final


def write_recorded_table(run: Run, data: pl.DataFrame, table: str, final: Path) -> Path:
    """``write_table`` for a file a manifest may cover (an evaluation written after its iteration
    finished, or at the top of the run): written, recorded, then renamed into place."""
    pending = final.parent / f".{final.name}.pending.tmp"
    write_table(data, table, pending)
    try:
        return publish_recorded(run, final, pending)
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
