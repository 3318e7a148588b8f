"""What the Monte-Carlo oracle cost in runs made with it: per iteration, the distinct starts it played
from, its continuations and their policy turns per rollout turn, and its seconds beside the rollout's
and the whole iteration's (the runs' own metrics rows; mean over the runs' iterations).

    python -m bench.probes.oracle_cost RUN [RUN ...] [--results FILE --section TITLE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from bench.section_writer import write_section

COLUMNS = (
    ("steps", "rollout turns"),
    ("oracle_starts", "distinct starts"),
    ("oracle_continuations", "continuations"),
    ("oracle_turns_per_step", "continuation turns per rollout turn"),
    ("oracle_seconds", "oracle s"),
    ("rollout_seconds", "rollout s (without the oracle)"),
    ("seconds_iteration", "iteration s"),
)


def iteration_costs(run_dir: Path) -> pl.DataFrame:
    rows = []
    for iter_dir in sorted(run_dir.glob("iter_*")):
        roll, loop = iter_dir / "metrics_rollout.parquet", iter_dir / "metrics_loop.parquet"
        if not roll.is_file() or not loop.is_file():
            continue
        m = pl.concat([pl.read_parquet(roll), pl.read_parquet(loop)], how="diagonal_relaxed")
        m = m.filter(pl.col("task_type").is_null()) if "task_type" in m.columns else m
        v = dict(zip(m["name"], m["value"], strict=False))
        if "oracle_starts" not in v:
            continue
        steps = pl.read_parquet(iter_dir / "steps.parquet", columns=["step"]).height
        rows.append(
            {**{k: v.get(k) for k, _ in COLUMNS}, "steps": steps, "rollout_seconds": v.get("seconds")}
        )
    return pl.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.oracle_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--results", default=None)
    parser.add_argument("--section", default="Oracle cost")
    args = parser.parse_args()
    frame = pl.concat([iteration_costs(Path(r)) for r in args.runs])
    means = frame.mean().row(0, named=True)
    head = "| " + " | ".join(label for _, label in COLUMNS) + " |\n|" + "---:|" * len(COLUMNS)
    table = head + "\n| " + " | ".join(f"{means[k]:.1f}" for k, _ in COLUMNS) + " |"
    body = (
        f"Mean over {frame.height} iterations of {', '.join(Path(r).name for r in args.runs)} (each run's own "
        "metrics; 2 CPU cores shared with other jobs, so the seconds vary with their load).\n\n" + table
    )
    print(body)
    if args.results:
        write_section(Path(args.results), args.section, body)


if __name__ == "__main__":
    main()
