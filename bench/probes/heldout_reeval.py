"""Held-out success of finished benchmark runs, re-measured on more held-out episodes than the runs
played, without touching the runs (nothing is written into them).

For each run ``<variant>-s<seed>``: the checkpoint of ``--iter`` (default: the last one) plays the eval
split with the run's config and ``--set`` overrides (e.g. ``env.eval_tasks=64``), at the run's eval
seed; then every variant's success is paired by seed with ``--baseline``'s (mean ± s.e. of the
per-seed differences, and the rule: ahead when the mean is above 2 s.e.).

    python -m bench.probes.heldout_reeval RUN [RUN ...] --baseline grpo --set env.eval_tasks=64
        [--results docs/results/credit-headroom.md --section "..."]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.section_writer import write_section


def last_iteration(run_dir: Path) -> int:
    done = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("iter_*"))
    if not done:
        raise SystemExit(f"{run_dir}: no checkpoint")
    return done[-1]


def reevaluate(run_dir: Path, iteration: int | None, overrides: list[str]) -> tuple[float, float]:
    """(success, episodes) of the run's checkpoint on the eval split with ``overrides``."""
    import polars as pl

    from schemas.rundir import open_run
    from stages.evaluate.runner import evaluate_model, evaluated_policy

    run = open_run(run_dir)
    config = run.load_config(overrides)
    it = last_iteration(run_dir) if iteration is None else iteration
    model_dir = evaluated_policy(run, it, config)
    rows = evaluate_model(run, config, model_dir, it, model_dir.name, progress=False).rows
    overall = rows.filter(pl.col("task_type").is_null())
    if "split" in overall.columns:
        overall = overall.filter(pl.col("split").is_null())
    value = dict(zip(overall["name"], overall["value"], strict=True))
    return float(value["success_rate"]), float(value["episodes"])


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.heldout_reeval", description=__doc__.splitlines()[0]
    )
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--iter", type=int, default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--results", default=None)
    parser.add_argument("--section", default="Held-out success, re-measured")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    success: dict[str, dict[int, float]] = {}
    lines = ["| run | held-out success | episodes |", "|---|---:|---:|"]
    for r in args.runs:
        run_dir = Path(r)
        variant, seed = run_dir.name.rsplit("-s", 1)
        s, n = reevaluate(run_dir, args.iter, args.overrides)
        success.setdefault(variant, {})[int(seed)] = s
        lines.append(f"| {run_dir.name} | {s:.3f} | {n:.0f} |")
        print(lines[-1], flush=True)
    base = success[args.baseline]
    lines += [
        "",
        f"| variant − {args.baseline} | seeds | held-out, paired ± s.e. | ahead (> 2 s.e.) |",
        "|---|---|---|---|",
    ]
    for variant, by_seed in success.items():
        if variant == args.baseline:
            continue
        seeds = sorted(set(by_seed) & set(base))
        d = np.array([by_seed[s] - base[s] for s in seeds])
        se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan")
        ahead = "yes" if d.size > 1 and d.mean() > 2 * se else "no"
        lines.append(f"| {variant} | {len(seeds)} | {d.mean():+.3f} ± {se:.3f} | {ahead} |")
    table = "\n".join(lines)
    print(table)
    if args.results:
        body = (
            f"The runs' checkpoints (iteration {args.iter if args.iter is not None else 'last'}) on the eval split "
            f"with `{' '.join(args.overrides)}`, at each run's eval seed; nothing written into the runs.\n\n"
            + table
        )
        write_section(Path(args.results), args.section, body)


if __name__ == "__main__":
    main()
