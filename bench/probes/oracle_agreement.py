"""How close each estimator's credit is to the Monte-Carlo oracle's on the same rollouts.

Reads the iterations of runs made with ``advantage.estimator = "oracle"`` (their ``steps.parquet`` and
``oracle.parquet``), computes every named estimator's advantages on those steps with the run's own
config, and compares them row by row with the oracle's A (reward units, ``stages.credit.advantage.oracle``):

* sign agreement: share of rows with oracle A ≠ 0 where the estimator's advantage has the same sign
  (a 0 counts as a disagreement);
* correlation: Pearson correlation of the two over all rows;
* MSE: mean squared difference after scaling each to unit std over the iteration's rows (the
  estimators' units differ: reward units, or std units after normalization).

Pooled over the runs' iterations (mean over iterations, each iteration weighted by its rows).

    python -m bench.probes.oracle_agreement RUN [RUN ...] [--estimators graft gigpo graphmc rloo grpo]
        [--results docs/results/credit-headroom.md --section "..."]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import polars as pl

from bench.section_writer import write_section

ESTIMATORS = ("graft", "gigpo", "graphmc", "rloo", "grpo")


def _unit(x: np.ndarray) -> np.ndarray:
    s = float(np.std(x))
    return x / s if s > 0 else x


def agreement(oracle_a: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Sign agreement (rows with oracle A ≠ 0), Pearson correlation and unit-scaled MSE of two credits."""
    nonzero = np.abs(oracle_a) > 1e-9
    sign = float(np.mean(np.sign(other[nonzero]) == np.sign(oracle_a[nonzero]))) if nonzero.any() else np.nan
    spread = np.std(oracle_a) > 0 and np.std(other) > 0
    corr = float(np.corrcoef(oracle_a, other)[0, 1]) if spread else np.nan
    mse = float(np.mean((_unit(oracle_a) - _unit(other)) ** 2))
    return {
        "sign": sign,
        "corr": corr,
        "mse": mse,
        "rows": float(oracle_a.size),
        "nonzero": float(nonzero.sum()),
    }


def iteration_agreement(iter_dir: Path, config, estimators: list[str]) -> dict[str, dict[str, float]]:
    """Per estimator, its agreement with the oracle on one iteration of an oracle run."""
    import dataclasses

    from schemas import read_table
    from stages import credit
    from stages.credit.advantage.oracle import oracle_step_advantages

    steps = read_table(iter_dir / "steps.parquet", "steps")
    table = read_table(iter_dir / "oracle.parquet", "oracle")
    oracle_a = oracle_step_advantages(steps, table, config.solve.gamma)
    nodes, edges = credit.graph(steps, config.graph.canonicalize, validate=False)
    values = credit.solve(nodes, edges, config.solve.gamma)
    out = {}
    for name in estimators:
        adv = credit.advantages(
            steps, nodes, edges, values, dataclasses.replace(config.advantage, estimator=name),
            validate=False, gamma=config.solve.gamma,
        )  # fmt: skip
        out[name] = agreement(oracle_a, adv["advantage"].to_numpy())
    return out


def pooled(runs: list[Path], estimators: list[str]) -> pl.DataFrame:
    """Agreement per estimator, pooled (row-weighted) over every finished iteration of ``runs``."""
    from schemas.rundir import open_run

    rows = []
    for run_dir in runs:
        config = open_run(run_dir).saved_config()
        for iter_dir in sorted(run_dir.glob("iter_*")):
            if not (iter_dir / "oracle.parquet").is_file() or not (iter_dir / "steps.parquet").is_file():
                continue
            for name, m in iteration_agreement(iter_dir, config, estimators).items():
                rows.append({"estimator": name, "run": run_dir.name, **m})
    frame = pl.DataFrame(rows)
    w = pl.col("rows")
    return frame.group_by("estimator", maintain_order=True).agg(
        ((pl.col("sign") * pl.col("nonzero")).sum() / pl.col("nonzero").sum()).alias("sign agreement"),
        ((pl.col("corr") * w).sum() / w.sum()).alias("correlation"),
        ((pl.col("mse") * w).sum() / w.sum()).alias("MSE (unit-scaled)"),
        pl.col("rows").sum().cast(pl.Int64).alias("rows"),
    )


def markdown(frame: pl.DataFrame) -> str:
    head = (
        "| estimator | sign agreement | correlation | MSE (unit-scaled) | rows |\n|---|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['estimator']} | {r['sign agreement']:.3f} | {r['correlation']:.3f} | {r['MSE (unit-scaled)']:.3f} | {r['rows']} |"
        for r in frame.iter_rows(named=True)
    ]
    return "\n".join([head, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.oracle_agreement", description=__doc__.splitlines()[0]
    )
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS))
    parser.add_argument("--results", default=None)
    parser.add_argument("--section", default="Agreement with the oracle")
    args = parser.parse_args()
    table = markdown(pooled([Path(r) for r in args.runs], args.estimators))
    print(table)
    if args.results:
        body = (
            f"Runs: {', '.join(Path(r).name for r in args.runs)}; every finished iteration, the estimators "
            "computed on the oracle run's own rollouts with its config.\n\n" + table
        )
        write_section(Path(args.results), args.section, body)


if __name__ == "__main__":
    main()
