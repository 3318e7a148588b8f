"""Learning benchmark (SPEC §10): the quickstart setting, several seeds, one run per estimator variant;
success rate vs iteration written as tables into BENCHMARKS.md, section "Learning".

    python bench/learning_bench.py [--iters 20] [--seeds 0 1 2] [--variants graft grpo gigpo graft-traj]
                                   [--out bench_runs/learning] [--set key=value ...] [--no-write]

Variants: ``graft`` (GRAFT, Graph GAE), ``graft-traj`` (GRAFT with trajectory GAE), ``graft-td``
(no GAE), ``grpo``, ``gigpo``, ``rloo``, ``salt``, ``graphgpo``, ``rtmc``. Each run is a normal
``graft loop`` run directory under ``--out`` (resumable: rerunning the script continues unfinished
runs and reuses finished ones). The training success of iteration i is the rollout success of the
policy after i updates (groups × group_size episodes on the fixed training tasks).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage_share import loop_seconds, markdown, stage_shares  # noqa: E402

from graft_cli.commands.loop import resolve_loop_run  # noqa: E402
from stages.loop import run_loop  # noqa: E402
from stages.report import load_run_tables, training_curve  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "graft": ["advantage.estimator=graft", "advantage.gae=graph"],
    "graft-traj": ["advantage.estimator=graft", "advantage.gae=trajectory"],
    "graft-td": ["advantage.estimator=graft", "advantage.gae=none"],
    "grpo": ["advantage.estimator=grpo"],
    "gigpo": ["advantage.estimator=gigpo"],
    "rloo": ["advantage.estimator=rloo"],
    "salt": ["advantage.estimator=salt"],
    "graphgpo": ["advantage.estimator=graphgpo"],
    "rtmc": ["advantage.estimator=rtmc"],
}
SECTION = "## Learning"


def run_variant(
    config: Path, out: Path, variant: str, seed: int, iters: int, extra: list[str]
) -> tuple[Path, float]:
    """Run (or resume) one variant × seed; return its run directory and the seconds this call took."""
    overrides = [*VARIANTS[variant], f"run.seed={seed}", f"run.name={variant}-s{seed}", *extra]
    run_dir = out / f"{variant}-s{seed}"
    start = time.perf_counter()
    run, cfg, target = resolve_loop_run(str(config), str(run_dir), overrides, iters, False)
    run_loop(
        run,
        cfg,
        target,
        on_iteration=lambda r: print(f"  {variant} s{seed} iter {r.iteration} done", flush=True),
    )
    return run_dir, time.perf_counter() - start


def success_table(runs: dict[str, list[Path]], every: int) -> tuple[str, dict[str, np.ndarray]]:
    """Markdown: rows = iteration, columns = variant, cells = mean ± std over seeds of training success."""
    from schemas.rundir import open_run

    curves: dict[str, np.ndarray] = {}
    for variant, dirs in runs.items():
        per_seed = []
        for d in dirs:
            c = training_curve(load_run_tables(open_run(d)).metrics, "success_rate")
            per_seed.append(c["value"].to_numpy())
        n = min(len(c) for c in per_seed)
        curves[variant] = np.stack([c[:n] for c in per_seed])  # (seeds, iterations)
    n_iter = min(c.shape[1] for c in curves.values())
    rows = sorted(set(range(0, n_iter, every)) | {n_iter - 1})
    header = "| iteration | " + " | ".join(curves) + " |"
    lines = [header, "|" + "---|" * (len(curves) + 1)]
    for i in rows:
        cells = [
            f"{c[:, i].mean():.3f} ± {c[:, i].std(ddof=1) if c.shape[0] > 1 else 0.0:.3f}"
            for c in curves.values()
        ]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    last = min(5, n_iter)

    def mean_se(per_seed: np.ndarray) -> str:  # mean ± standard error over seeds
        se = per_seed.std(ddof=1) / np.sqrt(len(per_seed)) if len(per_seed) > 1 else 0.0
        return f"{per_seed.mean():.3f} ± {se:.3f}"

    cells = [mean_se(c[:, -last:].mean(axis=1)) for c in curves.values()]
    lines.append(f"| mean of last {last} (± s.e.) | " + " | ".join(cells) + " |")
    cells = [mean_se(c[:, :n_iter].mean(axis=1)) for c in curves.values()]
    lines.append("| mean over all iterations (± s.e.) | " + " | ".join(cells) + " |")
    return "\n".join(lines), curves


def eval_table(runs: dict[str, list[Path]]) -> str:
    """Markdown: held-out success of the initial and the last evaluated policy, mean over seeds."""
    from schemas.rundir import open_run

    lines = ["| variant | eval success, initial | eval success, last (updates) |", "|---|---|---|"]
    for variant, dirs in runs.items():
        first, last, xs = [], [], []
        for d in dirs:
            ev = load_run_tables(open_run(d)).eval.filter(
                (pl.col("name") == "success_rate") & pl.col("task_type").is_null()
            )
            if ev.height == 0:
                continue
            ev = ev.sort("x")
            first.append(ev["value"][0])
            last.append(ev["value"][-1])
            xs.append(int(ev["x"][-1]))
        if first:
            lines.append(f"| {variant} | {np.mean(first):.3f} | {np.mean(last):.3f} ({max(xs)}) |")
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    """Replace (or append) the "## Learning" section of BENCHMARKS.md, leaving other sections alone."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    section = f"{SECTION}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text.rstrip() + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "quickstart.toml"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=["graft", "grpo", "gigpo", "graft-traj"])
    parser.add_argument("--out", default=str(ROOT / "bench_runs" / "learning"))
    parser.add_argument("--set", dest="extra", action="append", default=[])
    parser.add_argument("--every", type=int, default=2, help="table row every N iterations")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    parser.add_argument("--note", default="", help="Markdown paragraph put at the top of the section")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    runs: dict[str, list[Path]] = {v: [] for v in args.variants}
    seconds: dict[str, list[float]] = {v: [] for v in args.variants}
    for seed in args.seeds:  # seed-major, so a cut-short bench still has every variant
        for variant in args.variants:
            run_dir, took = run_variant(Path(args.config), out, variant, seed, args.iters, args.extra)
            runs[variant].append(run_dir)
            seconds[variant].append(took)
            print(f"{variant} seed {seed}: {took:.0f} s", flush=True)
    table, _ = success_table(runs, args.every)
    # loop seconds recorded by the runs themselves (a reused run keeps the time it took when it ran)
    timing = ", ".join(
        f"{v} {loop_seconds([str(d) for d in dirs])['seconds'].sum() / len(dirs):.0f} s"
        for v, dirs in runs.items()
    )
    body = "\n\n".join(
        ([args.note] if args.note else [])
        + [
            f"Setting: `{Path(args.config).name}`"
            + (f" with `{' '.join(args.extra)}`" if args.extra else "")
            + f", {args.iters} iterations, seeds {args.seeds}, "
            "training-rollout success rate (mean ± std over seeds) of the policy after i updates. "
            "Command: `python bench/learning_bench.py "
            + f"--iters {args.iters} --seeds {' '.join(map(str, args.seeds))} --variants {' '.join(args.variants)}`.",
            table,
            "Held-out evaluation (eval split of the same environment):",
            eval_table(runs),
            f"Loop seconds per run, mean over seeds (sum of `seconds_iteration`; 2 CPU cores shared with other jobs, so these vary with their load): {timing}.",
            "Share of loop time per stage (all runs above pooled, `bench/stage_share.py`):",
            markdown(stage_shares(loop_seconds([str(d) for dirs in runs.values() for d in dirs]))),
        ]
    )
    print(body)
    if not args.no_write:
        write_section(ROOT / "BENCHMARKS.md", body)


if __name__ == "__main__":
    main()
