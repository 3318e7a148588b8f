"""The training loop (docs/design.md §8): rollout → graph → solve → advantage → update per iteration, resumable.

Every stage writes its outputs atomically, so a stage whose outputs exist is complete and is skipped
on the next start (after their checksums verify: a damaged output makes the stage run again); a loop killed at any moment (SIGKILL included) resumes where it stopped and ends
with the same tables as an uninterrupted run (each stage is deterministic given its inputs and the
seeds of ``(run.seed, iteration, purpose)``).

Per iteration the loop also writes ``iter_NNNN/metrics_loop.parquet`` (stage ``loop``: wall-clock
seconds per stage, names ``seconds_<stage>`` and ``seconds_iteration``) and, every
``run.eval_every`` iterations and at the last one, ``iter_NNNN/eval.parquet`` for the checkpoint the
update of that iteration wrote. With ``eval.initial`` the initial policy is evaluated once, into
``eval.parquet`` at the run root (iter = -1). When every stage is done the iteration's tables are
checked against each other and recorded in ``iter_NNNN/manifest.json`` (schemas/manifest.py), and
``metrics_loop.parquet`` is written last: its presence marks an iteration as finished. A resumed loop
first verifies every finished iteration against its manifest and refuses a changed one.

After each finished iteration the loop applies checkpoint retention (``[checkpoint]``,
``stages/update/retention.py``) and feeds the optional live logger (``[log]``, ``stages/observe/live_log.py``).

Timing of stages that already ran in an earlier (killed) process is kept in a small sidecar
(``iter_NNNN/.loop_seconds.json``) so a resumed iteration still reports every stage.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from schemas import read_table
from schemas.atomic import atomic_write_text
from schemas.config import Config
from schemas.confine import refuse_links_inside
from schemas.jsonfile import load_json
from schemas.lock import run_lock
from schemas.manifest import (
    acting_checkpoint,
    cross_check,
    ensure_run_manifest,
    finish_iteration,
    iteration_finished,
    record_file,
    verify_finished,
)
from schemas.metrics import metrics_frame
from schemas.rundir import DERIVED_FILES, STAGE_NAMES, STAGE_OUTPUTS, STAGES, Run
from schemas.stage_table import STAGE_TABLE
from stages.cluster import check_executor
from stages.envs.registry import make_environment
from stages.evaluate import episode_table, summary_rows
from stages.loop.stage import (  # noqa: F401  (STAGE_RUNNERS, check_runners: re-exported)
    STAGE_RUNNERS,
    Prepare,
    StageRunner,
    check_runners,
    run_stage,
)
from stages.observe.live_log import TensorBoardLogger, open_logger
from stages.policy.live_engine import close_engines
from stages.update.retention import prune_checkpoints

LOOP_TABLE = "metrics_loop"
# the tables of each stage the loop checks against each other before resuming an iteration
STAGE_TABLES: dict[str, tuple[str, ...]] = {s.name: s.tables for s in STAGE_TABLE}
SECONDS_SIDECAR = ".loop_seconds.json"


def eval_due(iteration: int, last: int, eval_every: int) -> bool:
    """Evaluate after ``iteration`` when eval is on and it is a multiple of eval_every or the last one."""
    if eval_every <= 0:
        return False
    return (iteration + 1) % eval_every == 0 or iteration == last


def loop_metrics(iteration: int, seconds: dict[str, float]) -> pl.DataFrame:
    """The ``metrics`` rows of the loop itself: ``seconds_<stage>`` and ``seconds_iteration``."""
    rows = {f"seconds_{s}": float(v) for s, v in seconds.items()}
    return metrics_frame(iteration, "loop", {**rows, "seconds_iteration": float(sum(seconds.values()))})


@dataclass
class IterationResult:
    """What one iteration did: seconds per stage (this and earlier processes) and stages skipped."""

    iteration: int
    seconds: dict[str, float] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    redone: dict[str, list[str]] = field(default_factory=dict)  # stage -> damage found in its outputs
    evaluated: bool = False


def _read_sidecar(path: Path) -> dict[str, float]:
    try:
        data = load_json(path)
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def remove_stale_temporaries(run: Run) -> list[Path]:
    """Delete temporary outputs a killed process left behind (``.<name>.<random>.tmp`` files and
    directories from ``write_table`` / ``atomic_write_text`` / ``atomic_dir``; the warm start's
    folders too); returns them."""
    removed = []
    warm = [run.sft_dir, run.sft_dir / "demos", run.sft_dir / "dagger"]
    warm += sorted((run.sft_dir / "dagger").glob("round_*"))
    folders = [run.root, run.root / "checkpoints", *warm, *(run.iter_dir(i) for i in run.iterations())]
    for folder in folders:
        refuse_links_inside(folder / "-")  # the folder and those above it: no link (schemas.confine)
        for path in folder.glob(".*.tmp"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def run_iteration(
    run: Run,
    iteration: int,
    config: Config,
    runners: dict[str, StageRunner],
    *,
    evaluate: bool,
    prepare: Prepare | None = None,
) -> IterationResult:
    """Run the missing stages of one iteration (and its evaluation when ``evaluate``), each through
    ``run_stage`` (``prepare``: what makes the initial policy where a stage uses it)."""
    result = IterationResult(iteration)
    folder = run.iter_dir(iteration)
    folder.mkdir(parents=True, exist_ok=True)
    sidecar = folder / SECONDS_SIDECAR
    seconds = _read_sidecar(sidecar)
    stages = list(STAGE_NAMES) if evaluate else list(STAGES)
    # finished stages whose outputs verify are skipped, damaged ones run again; the kept tables
    # must be one history before anything builds on them
    damage = {s: run.output_damage(s, iteration) for s in stages if run.stage_complete(s, iteration)}
    kept = [table for s, found in damage.items() if not found for table in STAGE_TABLES[s]]
    if kept:
        cross_check(run, iteration, kept)
    for stage in stages:
        if stage in damage:
            if not damage[stage]:
                result.skipped.append(stage)
                continue
            result.redone[stage] = damage[stage]  # a damaged finished output: run the stage again
        seconds[stage] = run_stage(
            run, stage, iteration, config, runner=runners[stage], prepare=prepare
        ).seconds
        result.ran.append(stage)
        atomic_write_text(sidecar, json.dumps(seconds))
    result.seconds = {s: seconds.get(s, 0.0) for s in stages}
    result.evaluated = evaluate
    fresh = {name for stage in result.ran for name in (*STAGE_OUTPUTS[stage], *DERIVED_FILES[stage])}
    # the tables checked against each other and recorded, then the done-marker
    finish_iteration(run, iteration, loop_metrics(iteration, result.seconds), fresh=fresh)
    return result


def check_resumable(run: Run, iters: int) -> None:
    """Every finished iteration still holds what its manifest records (sizes and sha256 of its files,
    its checkpoint's checksums; files unchanged since an earlier check are not hashed again), so do
    the tables at the top of the run, and the checkpoint the next iteration acts with is intact; else
    a GraftError naming the file and what to run -- a resumed loop never builds on, nor reports
    "nothing to do" over, a changed iteration. Reads only."""
    verify_finished(run)
    pending = [i for i in range(iters) if not iteration_finished(run, i)]
    if pending and pending[0] > 0 and iteration_finished(run, pending[0] - 1):
        acting_checkpoint(run, pending[0], "rollout")


def run_loop(
    run: Run,
    config: Config,
    iters: int,
    *,
    runners: dict[str, StageRunner] | None = None,
    on_iteration: Callable[[IterationResult], None] | None = None,
    prepare: Prepare | None = None,
    on_initial_eval: Callable[[float], None] | None = None,
) -> list[IterationResult]:
    """Run iterations 0..iters-1 of ``run``, skipping finished ones and finished stages.

    ``runners`` (default ``STAGE_RUNNERS``, with the rollout on Ray actors when
    ``cluster.executor = "ray"``) maps each stage to its function; tests pass fakes or wrappers.
    ``prepare`` (default ``ensure_initial_model``) builds the initial model where a stage first uses
    it (``stages.loop.stage.uses_initial_policy``).
    ``on_iteration`` is called after each iteration (the CLI prints its line there), and
    ``on_initial_eval`` with its seconds after the initial policy was evaluated in this call.
    """
    with run_lock(run.root):
        logger = open_logger(run, config)
        try:
            with executor_runners(config, runners) as stage_runners:
                return _run_loop_locked(
                    run, config, iters, stage_runners, on_iteration, prepare, logger, on_initial_eval
                )
        finally:
            close_engines()
            if logger is not None:
                logger.close()


@contextmanager
def executor_runners(
    config: Config, runners: dict[str, StageRunner] | None
) -> Iterator[dict[str, StageRunner] | None]:
    """The loop's stage runners: ``runners`` when given (tests), else None (``STAGE_RUNNERS``) for
    ``cluster.executor = "local"``, or ``STAGE_RUNNERS`` with the rollout on a pool of Ray actors for
    ``"ray"`` (``stages/cluster/ray_executor.py``; Ray starts at the first rollout and stops after)."""
    if runners is not None or config.cluster.executor == "local":
        yield runners
        return
    check_executor(config)  # one line, not an ImportError, where ray is missing
    from stages.cluster.ray_executor import RayRolloutPool

    with RayRolloutPool() as pool:
        yield {**STAGE_RUNNERS, "rollout": pool}


def _run_loop_locked(
    run: Run,
    config: Config,
    iters: int,
    runners: dict[str, StageRunner] | None,
    on_iteration: Callable[[IterationResult], None] | None,
    prepare: Prepare | None,
    logger: TensorBoardLogger | None = None,
    on_initial_eval: Callable[[float], None] | None = None,
) -> list[IterationResult]:
    runners = runners if runners is not None else STAGE_RUNNERS
    remove_stale_temporaries(run)
    check_resumable(run, iters)  # before anything reads, prunes or extends the run
    ensure_run_manifest(run)
    prune_checkpoints(run, config.checkpoint)  # a loop killed before pruning catches up here
    if config.eval.initial and config.run.eval_every > 0 and not (run.initial_eval_path).is_file():
        # iteration -1 = the initial policy; the eval runner writes <run>/eval.parquet for it
        start = time.perf_counter()
        run_stage(run, "eval", -1, config, runner=runners["eval"], prepare=prepare)
        if run.initial_eval_path.is_file():
            record_file(run, run.initial_eval_path)  # (the eval stage records it already)
        if logger is not None:
            logger.log_iteration(run, -1)
        if on_initial_eval is not None and run.initial_eval_path.is_file():
            on_initial_eval(time.perf_counter() - start)
    if logger is not None:
        initial = [-1] if run.initial_eval_path.is_file() else []
        logger.catch_up(run, initial + [i for i in run.iterations() if iteration_finished(run, i)])
    results = []
    for iteration in range(iters):
        if iteration_finished(run, iteration):
            continue
        due = eval_due(iteration, iters - 1, config.run.eval_every)
        result = run_iteration(run, iteration, config, runners, evaluate=due, prepare=prepare)
        prune_checkpoints(run, config.checkpoint)  # after the iteration's evaluation: it keeps its checkpoint
        if logger is not None:
            logger.log_iteration(run, iteration)
        results.append(result)
        if on_iteration is not None:
            on_iteration(result)
    return results


def iteration_summary(run: Run, iteration: int, config: Config) -> dict[str, float]:
    """Overall success_rate / mean_return / mean_turns of an iteration's rollouts (and its eval).

    Taken from the rollout's metrics rows when present, else computed from the steps table.
    """
    out: dict[str, float] = {}
    metrics_path = run.iter_dir(iteration) / "metrics_rollout.parquet"
    if metrics_path.is_file():
        rows = read_table(metrics_path, "metrics").filter(pl.col("task_type").is_null())
        out = {r["name"]: r["value"] for r in rows.iter_rows(named=True)}
    if not {"success_rate", "mean_return", "mean_turns"} <= out.keys() and run.stage_complete(
        "rollout", iteration
    ):
        success = float(make_environment(config).success_outcome)
        rows = summary_rows(episode_table(run.read(iteration, "steps"), success)).filter(
            pl.col("task_type").is_null()
        )
        out.update({r["name"]: r["value"] for r in rows.iter_rows(named=True) if r["name"] not in out})
    eval_path = run.table_path(iteration, "eval")
    if eval_path.is_file():
        rows = read_table(eval_path, "eval").filter(pl.col("task_type").is_null() & pl.col("split").is_null())
        out.update({f"eval_{r['name']}": r["value"] for r in rows.iter_rows(named=True)})
    return out
