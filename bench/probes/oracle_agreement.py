"""How close each estimator's credit is to the Monte-Carlo oracle's on the same rollouts.

Reads the iterations of runs made with ``advantage.estimator = "oracle"`` (their ``steps.parquet`` and
``oracle.parquet``), computes every named estimator's advantages on those steps with the run's own
config, and compares them row by row with the oracle's A (reward units, ``stages.credit.advantage.oracle``):

* sign agreement: share of rows with oracle A ≠ 0 where the estimator's advantage has the same sign
  (a 0 counts as a disagreement); beside it the share of those rows the estimator credits at all (≠ 0);
* correlation: Pearson correlation of the two over all rows;
* MSE: mean squared difference after scaling each to unit std over the iteration's rows (the
  estimators' units differ: reward units, or std units after normalization);
* the row "oracle itself": the square root of the share of the oracle's variance that is not its own
  Monte-Carlo noise (from each start's return std and K), the correlation a perfect credit would have
  with the oracle's noisy A.

Pooled over the runs' iterations (mean over iterations, each iteration weighted by its rows). With
``--by-turn`` the rows are split by the turn they were played at (the first turn, whose state every
rollout of a group shares; turns 2–4; turns 5 and later) and each part is compared on its own.

    python -m bench.probes.oracle_agreement RUN [RUN ...] [--estimators graft gigpo graphmc rloo grpo]
        [--by-turn] [--results docs/results/credit-headroom.md --section "..."]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import polars as pl

from bench.section_writer import write_section

ESTIMATORS = ("graft", "gigpo", "graphmc", "rloo", "grpo")
ALL_TURNS = "all turns"
# (first step index, last step index or None, label); step indices count from 0
TURN_PARTS = ((0, 0, "turn 1"), (1, 3, "turns 2–4"), (4, None, "turns 5+"))


def turn_part(step: np.ndarray) -> np.ndarray:
    """The label of TURN_PARTS each row's 0-based step index falls in (shape of ``step``)."""
    out = np.empty(step.shape, dtype=object)
    for first, last, label in TURN_PARTS:
        out[(step >= first) & ((step <= last) if last is not None else True)] = label
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    s = float(np.std(x))
    return x / s if s > 0 else x


def agreement(oracle_a: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Sign agreement (rows with oracle A ≠ 0), Pearson correlation and unit-scaled MSE of two credits."""
    nonzero = np.abs(oracle_a) > 1e-9
    sign = float(np.mean(np.sign(other[nonzero]) == np.sign(oracle_a[nonzero]))) if nonzero.any() else np.nan
    credited = float(np.mean(np.abs(other[nonzero]) > 1e-9)) if nonzero.any() else np.nan
    spread = np.std(oracle_a) > 0 and np.std(other) > 0
    corr = float(np.corrcoef(oracle_a, other)[0, 1]) if spread else np.nan
    mse = float(np.mean((_unit(oracle_a) - _unit(other)) ** 2))
    return {
        "sign": sign,
        "credited": credited,
        "corr": corr,
        "mse": mse,
        "rows": float(oracle_a.size),
        "nonzero": float(nonzero.sum()),
    }


def iteration_agreement(
    iter_dir: Path, config, estimators: list[str], by_turn: bool = False
) -> list[dict[str, float | str]]:
    """Rows {estimator, part, metrics}: each estimator's agreement with the oracle on one iteration of an
    oracle run, over all rows (part "all turns") or, with ``by_turn``, per part of TURN_PARTS."""
    import dataclasses

    from schemas import read_table
    from stages import credit
    from stages.credit.advantage.oracle import oracle_step_advantages

    steps = read_table(iter_dir / "steps.parquet", "steps")
    table = read_table(iter_dir / "oracle.parquet", "oracle")
    oracle_a = oracle_step_advantages(steps, table, config.solve.gamma)
    noise = oracle_noise_rows(steps, table, config.solve.gamma)
    nodes, edges = credit.graph(steps, config.graph.canonicalize, validate=False)
    values = credit.solve(nodes, edges, config.solve.gamma)
    credits = {
        name: credit.advantages(
            steps, nodes, edges, values, dataclasses.replace(config.advantage, estimator=name),
            validate=False, gamma=config.solve.gamma,
        )["advantage"].to_numpy()
        for name in estimators
    }  # fmt: skip
    parts = (
        turn_part(steps["step"].to_numpy()) if by_turn else np.full(oracle_a.shape, ALL_TURNS, dtype=object)
    )
    out: list[dict[str, float | str]] = []
    for label in dict.fromkeys(parts.tolist()):
        rows = parts == label
        for name, adv in credits.items():
            out.append({"estimator": name, "part": label, **agreement(oracle_a[rows], adv[rows])})
        var = float(np.var(oracle_a[rows]))
        out.append({
            "estimator": "oracle itself", "part": label,
            "sign": np.nan, "credited": np.nan, "mse": np.nan, "rows": float(rows.sum()), "nonzero": 0.0,
            # the oracle's own reliability: share of its variance that is not Monte-Carlo noise (its
            # square root bounds any credit's correlation with it)
            "corr": float(np.sqrt(max(0.0, 1.0 - float(noise[rows].mean()) / var))) if var > 0 else np.nan,
        })  # fmt: skip
    return out


def oracle_noise(steps: pl.DataFrame, table: pl.DataFrame, gamma: float) -> float:
    """Mean Monte-Carlo variance of the oracle's A over the rows (oracle_noise_rows)."""
    rows = oracle_noise_rows(steps, table, gamma)
    return float(rows.mean()) if rows.size else 0.0


def oracle_noise_rows(steps: pl.DataFrame, table: pl.DataFrame, gamma: float) -> np.ndarray:
    """Monte-Carlo variance of the oracle's A per row of ``steps`` (shape (rows,), reward units²):
    Var V̂(s) = σ²(s) / K per start, and A = r + γ V̂(s') − V̂(s) adds the two (independent
    continuations)."""
    var = table.select(
        "group_id", pl.col("step").cast(pl.Int32), "state",
        (pl.col("return_std") ** 2 / pl.col("continuations")).alias("var"),
    )  # fmt: skip
    rows = steps.select("group_id", pl.col("step").cast(pl.Int32), "state", "next_state", "done")
    here = rows.join(var, on=["group_id", "step", "state"], how="left")
    nxt = var.rename({"state": "next_state", "var": "next_var"}).with_columns(pl.col("step") - 1)
    both = here.join(nxt, on=["group_id", "step", "next_state"], how="left")
    total = both["var"].fill_null(0.0) + gamma**2 * both["next_var"].fill_null(0.0) * (~both["done"]).cast(
        float
    )
    return total.to_numpy()


def pooled(runs: list[Path], estimators: list[str], by_turn: bool = False) -> pl.DataFrame:
    """Agreement per estimator (and part of the turns), pooled (row-weighted) over every finished
    iteration of ``runs``."""
    from schemas.rundir import open_run

    rows = []
    for run_dir in runs:
        config = open_run(run_dir).saved_config()
        for iter_dir in sorted(run_dir.glob("iter_*")):
            if not (iter_dir / "oracle.parquet").is_file() or not (iter_dir / "steps.parquet").is_file():
                continue
            for m in iteration_agreement(iter_dir, config, estimators, by_turn):
                rows.append({"run": run_dir.name, **m})
    frame = pl.DataFrame(rows)
    w = pl.col("rows")
    return frame.group_by("part", "estimator", maintain_order=True).agg(
        ((pl.col("sign") * pl.col("nonzero")).sum() / pl.col("nonzero").sum()).alias("sign agreement"),
        ((pl.col("credited") * pl.col("nonzero")).sum() / pl.col("nonzero").sum()).alias("credited"),
        ((pl.col("corr") * w).sum() / w.sum()).alias("correlation"),
        ((pl.col("mse") * w).sum() / w.sum()).alias("MSE (unit-scaled)"),
        pl.col("rows").sum().cast(pl.Int64).alias("rows"),
    )


def markdown(frame: pl.DataFrame) -> str:
    def cell(x: float) -> str:
        return "—" if x is None or np.isnan(x) else f"{x:.3f}"

    by_part = frame["part"].n_unique() > 1
    head = (
        ("| turns " if by_part else "")
        + "| estimator | sign agreement | rows it credits (≠ 0) | correlation | MSE (unit-scaled) | rows |\n"
        + ("|---" if by_part else "")
        + "|---|---:|---:|---:|---:|---:|"
    )
    lines = [
        (f"| {r['part']} " if by_part else "")
        + f"| {r['estimator']} | {cell(r['sign agreement'])} | {cell(r['credited'])} | {cell(r['correlation'])} | "
        f"{cell(r['MSE (unit-scaled)'])} | {r['rows']} |"
        for r in frame.iter_rows(named=True)
    ]
    return "\n".join([head, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.oracle_agreement", description=__doc__.splitlines()[0]
    )
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS))
    parser.add_argument(
        "--by-turn", action="store_true", help="compare the rows of each part of the turns apart"
    )
    parser.add_argument("--results", default=None)
    parser.add_argument("--section", default="Agreement with the oracle")
    args = parser.parse_args()
    table = markdown(pooled([Path(r) for r in args.runs], args.estimators, args.by_turn))
    print(table)
    if args.results:
        body = (
            f"Runs: {', '.join(Path(r).name for r in args.runs)}; every finished iteration, the estimators "
            "computed on the oracle run's own rollouts with its config.\n\n" + table
        )
        write_section(Path(args.results), args.section, body)


if __name__ == "__main__":
    main()
