"""What the stage commands ask of a run beyond one ``run_stage`` call: ``graft advantage`` rebuilding a
stale graph and values first, ``graft eval`` of a named checkpoint, ``graft rollout``'s shards, their
merge and its folder mode, and ``graft sft``'s warm start. Each holds the run's lock across what it
checks and writes; every stage it runs goes through ``run_stage``. The commands in graft_cli/ parse,
call one of these (or ``run_stage``) and print."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import polars as pl

from schemas import write_table
from schemas.config import Config
from schemas.definitions import INITIAL_VERSION
from schemas.errors import GraftError
from schemas.lock import run_lock
from schemas.manifest import verify_finished
from schemas.rundir import Run
from stages.credit.advantage.registry import get_estimator
from stages.evaluate import EPISODES_FILE, evaluate_model, output_path, write_evaluation
from stages.evaluate.target import resolve_eval_target
from stages.loop.runner import remove_stale_temporaries
from stages.loop.stage import StageCommand, run_stage
from stages.rollout import merge_rollout_shards, rollout_iteration, run_rollout, shard_name
from stages.warmstart import initial


def advantage_on_run(run: Run, iteration: int, config: Config, command: StageCommand) -> list[Path]:
    """``graft advantage RUN --iter I``: the advantages, after the graph and the values when they are
    missing or when ``--set graph.*`` / ``solve.*`` (dotted keys or inline tables alike) changed what
    they are computed with (the resolved sections compared with the run's own). Returns what
    ``--force`` removed."""
    get_estimator(config.advantage.estimator)  # unknown names fail before any work
    saved = run.saved_config()
    new_graph = config.graph != saved.graph
    new_values = new_graph or config.solve != saved.solve
    removed: list[Path] = []
    with run_lock(run.root):
        redo_graph = new_graph or not run.stage_complete("graph", iteration)
        redo_solve = redo_graph or new_values or not run.stage_complete("solve", iteration)
        stages = ["graph"] * redo_graph + ["solve"] * redo_solve + ["advantage"]
        # the first stage's guard removes what depends on it, so the later ones find nothing finished
        for stage in stages:
            removed += run_stage(run, stage, iteration, config, command=command).removed
    return removed


@dataclass(frozen=True)
class Evaluation:
    """What ``graft eval`` scored: the eval rows, the checkpoint's name and the file they went to."""

    rows: pl.DataFrame
    name: str
    out: Path


def evaluate_on_run(
    run: Run, config: Config, checkpoint: str, iteration: int | None, force: bool
) -> Evaluation:
    """``graft eval RUN``: evaluate the checkpoint ``--checkpoint`` / ``--iter`` name
    (``stages.evaluate.target``) unless it is evaluated already (``force``: evaluate it again; nothing
    is computed from an evaluation, so only it is replaced). The run's own checkpoint or initial
    policy is its eval stage (``run_stage``); another model directory is not a stage of the run: its
    rows go to ``eval_<name>.parquet`` at the run's top."""
    with run_lock(run.root):
        it, model_dir, name, out = resolve_eval_target(run, config, checkpoint, iteration)
        if out.is_file() and not force:
            raise GraftError(f"{out}: {name} is already evaluated; use --force to evaluate it again")
        scored: list[pl.DataFrame] = []

        def evaluate(run: Run, it: int, config: Config) -> None:
            # the rest of the iteration (or of the run's top) is what was recorded: the evaluation is
            # recorded next to it
            at_top = out.parent.resolve() == run.root.resolve()
            replaced = {out.name, EPISODES_FILE} if out == output_path(run, it) else {out.name}
            verify_finished(run, [] if at_top else [it], skip={-1 if at_top else it: replaced})
            evaluated = evaluate_model(run, config, model_dir, it, name)
            scored.append(evaluated.rows)
            write_evaluation(run, evaluated, out)

        if out == output_path(run, it):
            run_stage(run, "eval", it, config, runner=evaluate, command=StageCommand(force=force))
        else:
            evaluate(run, it, config)
    return Evaluation(scored[0], name, out)


@dataclass(frozen=True)
class ShardPlay:
    """What ``graft rollout --shard i/n`` did: ``path`` (the merged steps table, or this share's file)
    and ``played`` (False: nothing was played -- the iteration or this share was played before)."""

    path: Path
    played: bool


def play_rollout_shard(
    run: Run, iteration: int, config: Config, shard: tuple[int, int], progress: bool
) -> ShardPlay:
    """One worker's share of an iteration's rollout, under a shared lock (shard workers write disjoint
    files side by side; a loop is still excluded). A finished steps table is never replaced by a shard,
    and a finished share is not played again; the worker that finds all shares merges them."""
    with run_lock(run.root, shared=True):
        if run.stage_complete("rollout", iteration):
            return ShardPlay(run.table_path(iteration, "steps"), played=False)
        own = run.iter_dir(iteration) / shard_name("steps", shard)
        played_before = own.is_file()
        runner = partial(run_rollout, shard=shard, progress=progress)
        run_stage(run, "rollout", iteration, config, runner=runner, shard=True)
    path = run.table_path(iteration, "steps") if run.stage_complete("rollout", iteration) else own
    return ShardPlay(path, played=not (played_before and path == own))


def merge_shards_on_run(run: Run, iteration: int, config: Config, shards: int) -> bool:
    """``graft rollout RUN --iter I --merge N``: merge the N shard files into ``steps.parquet``; False
    when the iteration's steps table exists already (nothing to merge)."""
    with run_lock(run.root):
        if run.stage_complete("rollout", iteration):
            return False
        if not merge_rollout_shards(run, iteration, config, shards):
            raise GraftError(
                f"{run.iter_dir(iteration)}: not all {shards} steps.shard-*-of-{shards} files exist yet"
            )
    return True


def rollout_to_folder(
    out: Path, config: Config, iteration: int, shard: tuple[int, int] | None, progress: bool
) -> Path:
    """``graft rollout --config X --out DIR``: play an iteration with the initial policy (made in
    ``DIR/model`` when it is the tiny model; DIR is no run) into ``DIR/steps[.shard-i-of-n].parquet``
    and its metrics."""
    model_dir = initial.ensure_initial_model(Run(out), config)
    steps, metrics = rollout_iteration(
        config, iteration, model_dir, INITIAL_VERSION, shard=shard, progress=progress
    )
    suffix = f".shard-{shard[0]}-of-{shard[1]}" if shard else ""
    write_table(metrics, "metrics", out / f"metrics_rollout{suffix}.parquet")
    return write_table(steps, "steps", out / f"steps{suffix}.parquet")


def warm_start(run: Run, config: Config) -> Path:
    """``graft sft RUN``: the run's initial policy (its warm start) made, or verified when made before;
    what a killed warm start left half-written is removed first."""
    if not config.sft.enabled:
        raise GraftError(
            f"{run.config_path}: sft.enabled is false, so no stage would use a warm start; start the run "
            "with --set sft.enabled=true (or an [sft] section with enabled = true)"
        )
    with run_lock(run.root):  # a loop or another sft on the same run waits or is refused
        remove_stale_temporaries(run)
        return initial.ensure_initial_model(run, config)
