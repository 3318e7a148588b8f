"""Running the learning benchmark: one ``graft loop`` run per (variant, seed) under ``--out``,
resumable, several at a time, with a seed's warm start computed once and copied to its other runs;
and reading a finished run back (its tables, finished iterations, seed, held-out evaluations).

Warm start: when the config enables ``[sft]``, the warm start depends on the seed and the config but
not on the estimator, so the first run of a seed computes it and the other variants of that seed get
a copy of its ``model/`` and ``sft/`` (the same bytes they would compute: the warm start is
deterministic); every variant of a seed starts from the same policy.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import polars as pl

from bench.learning.variants import VARIANTS
from stages.loop import run_loop
from stages.loop.start import resolve_loop_run
from stages.observe.report import load_run_tables

WARM_START_PARTS = ("model", "sft")


def share_warm_start(run_dir: Path, donors: list[Path]) -> None:
    """Copy a finished warm start (``model/``, ``sft/``) of a run of the same seed into ``run_dir``."""
    import shutil

    from schemas.integrity import checkpoint_complete

    if (run_dir / "sft").exists():
        return
    for donor in donors:
        if checkpoint_complete(donor / "sft" / "model"):
            for part in WARM_START_PARTS:
                if (donor / part).is_dir():  # no model/ when the base is model.path
                    shutil.copytree(donor / part, run_dir / part)
            return


def run_variant(
    config: Path, out: Path, variant: str, seed: int, iters: int, extra: list[str], donors: list[Path]
) -> tuple[Path, float]:
    """Run (or resume) one variant × seed; return its run directory and the seconds this call took.

    A run that finished all ``iters`` iterations is kept as it ran, not reopened: a config changed
    after it (another engine option, say) must not refuse it or make it run again."""
    overrides = [*VARIANTS[variant], f"run.seed={seed}", f"run.name={variant}-s{seed}", *extra]
    run_dir = out / f"{variant}-s{seed}"
    if finished_iterations(run_dir) >= iters:
        print(f"  {variant} s{seed}: finished ({iters} iterations), kept as it ran", flush=True)
        return run_dir, 0.0
    start = time.perf_counter()
    run, cfg, target = resolve_loop_run(str(config), str(run_dir), overrides, iters, False)
    if cfg.sft.enabled:
        share_warm_start(run_dir, donors)
    run_loop(
        run,
        cfg,
        target,
        on_iteration=lambda r: print(f"  {variant} s{seed} iter {r.iteration} done", flush=True),
    )
    return run_dir, time.perf_counter() - start


def run_job(
    config: Path,
    out: Path,
    variants: list[str],
    iters: int,
    extra: list[str],
    seed: int,
    variant: str,
    warm_from: Path | None = None,
) -> float:
    """One (seed, variant) run in a worker process (one torch thread); returns its seconds.
    ``warm_from``: a folder with ``warm-s<seed>`` warm starts computed beforehand (copied first)."""
    import torch

    torch.set_num_threads(1)
    donors = [out / f"{v}-s{seed}" for v in variants if v != variant]
    if warm_from is not None:
        donors.insert(0, warm_from / f"warm-s{seed}")
    return run_variant(config, out, variant, seed, iters, extra, donors)[1]


def run_jobs(
    jobs: list[tuple[int, str]],
    job: Callable[[int, str], float],
    workers: int,
    warm_seeds: set[int] | None = None,
) -> Iterator[tuple[tuple[int, str], float]]:
    """Run ``job(seed, variant)`` for every job, ``workers`` at a time, in the given order except
    that a job never starts while another worker computes its seed's warm start (it would compute
    the same bytes again): the first job of a seed computes it, the others of that seed wait for it
    and copy it. Yields (job, seconds) as runs finish."""
    if workers <= 1:
        for seed, variant in jobs:
            yield (seed, variant), job(seed, variant)
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pending, warm, warming = list(jobs), set(warm_seeds or ()), set()
    running: dict = {}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        while pending or running:
            while len(running) < workers:
                ready = next((j for j in pending if j[0] in warm or j[0] not in warming), None)
                if ready is None:
                    break
                pending.remove(ready)
                if ready[0] not in warm:
                    warming.add(ready[0])
                running[pool.submit(job, *ready)] = ready
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                seed, variant = running.pop(future)
                warm.add(seed)
                warming.discard(seed)
                yield (seed, variant), future.result()


@functools.cache
def run_tables(run_dir: Path):  # type: ignore[no-untyped-def]
    """The metrics and eval rows of one run, read once per bench invocation."""
    from schemas.rundir import open_run

    return load_run_tables(open_run(run_dir))


def finished_iterations(run_dir: Path) -> int:
    """Iterations 0..k-1 of ``run_dir`` that the loop finished (their metrics_loop table exists)."""
    k = 0
    while (run_dir / f"iter_{k:04d}" / "metrics_loop.parquet").is_file():
        k += 1
    return k


def run_seed(run_dir: Path) -> int:
    """The seed of a benchmark run directory ``<variant>-s<seed>``."""
    return int(run_dir.name.rsplit("-s", 1)[1])


def overall_evaluations(run_dir: Path) -> pl.DataFrame:
    """The eval rows of a run over all its tasks (no task type, no split)."""
    ev = run_tables(run_dir).eval.filter(pl.col("task_type").is_null())
    return ev.filter(pl.col("split").is_null()) if "split" in ev.columns else ev


def held_out(run_dir: Path) -> dict[str, float] | None:
    """The initial and the last evaluation of a run (overall rows): success, episodes, and x (the
    policy updates behind the last one); None for a run without evaluations."""
    ev = overall_evaluations(run_dir)
    success = ev.filter(pl.col("name") == "success_rate").sort("x")
    episodes = ev.filter(pl.col("name") == "episodes").sort("x")
    if success.height == 0:
        return None
    return {
        "initial": float(success["value"][0]),
        "initial_episodes": float(episodes["value"][0]) if episodes.height else float("nan"),
        "last": float(success["value"][-1]),
        "last_episodes": float(episodes["value"][-1]) if episodes.height else float("nan"),
        "x": float(success["x"][-1]),
    }
