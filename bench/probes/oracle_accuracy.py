"""The Monte-Carlo oracle's accuracy against exact A^π, beside graft's, on the estimator-accuracy MDPs.

The setting of docs/results/estimator-accuracy.md (``stages.credit.synth`` with ``truth=True``: 128
groups per seed, horizon 6, width 3, 3 actions + an invalid one at 10 %, merge 0.5, success reward 1,
truncation 0.1, γ = 1), N = 8 rollouts per group. The oracle plays K continuations of the known policy
from every distinct (group, turn, state) of those rollouts (``synth.continuation_returns``) and gives
``A = r + γ V̂(s') − V̂(s)`` (``stages.credit.advantage.oracle``); graft TD is the row of the
estimator-accuracy table computed here on the same rollouts. Cells: mean ± std over seeds of the MSE
against A^π and Spearman's ρ, and the oracle's continuations per step.

    python -m bench.probes.oracle_accuracy [--seeds 10] [--results docs/results/credit-headroom.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import polars as pl
from scipy.stats import spearmanr

from bench.section_writer import write_section

KNOBS = dict(
    groups=128,
    horizon=6,
    width=3,
    merge=0.5,
    invalid_rate=0.1,
    truncation=0.1,
    success_reward=1.0,
    cycles=0.1,
)
GAMMA = 1.0
N = 8
KS = (1, 2, 4, 8, 16, 32)


def one_seed(seed: int) -> dict[str, tuple[float, float, float]]:
    """{credit: (MSE, ρ, continuations per step)} on one seed's rollouts."""
    from stages import credit
    from stages.credit.advantage.oracle import oracle_starts, oracle_table
    from stages.credit.synth import continuation_returns, synth_mdps, synth_steps

    steps, truth = synth_steps(group_size=N, gamma=GAMMA, truth=True, seed=seed, **KNOBS)
    mdps = synth_mdps(truth=True, seed=seed, **KNOBS)
    target = truth["a_true"].to_numpy()
    out = {}
    graft = credit.advantages(steps, estimator="graft", gae="none", normalize="none", gamma=GAMMA)
    out["graft TD"] = (
        float(np.mean((graft["gae"].to_numpy() - target) ** 2)),
        spearmanr(graft["gae"], target)[0],
        0.0,
    )
    starts = oracle_starts(steps)
    parts = starts["state"].str.extract_groups(r"^g(\d+)/L(\d+)/s(\d+)")
    g, layer, pos = (parts.struct.field(f).cast(pl.Int64).to_numpy() for f in ("1", "2", "3"))
    rng = np.random.default_rng(10_000 + seed)
    for k in KS:
        returns = continuation_returns(mdps, g, layer, pos, k, GAMMA, rng)
        adv = credit.advantages(
            steps, estimator="oracle", oracle=oracle_table(starts, list(returns)), gamma=GAMMA
        )
        a = adv["gae"].to_numpy()
        out[f"oracle K={k}"] = (
            float(np.mean((a - target) ** 2)),
            spearmanr(a, target)[0],
            k * starts.height / steps.height,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.probes.oracle_accuracy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--results", default=None)
    parser.add_argument("--section", default="Oracle accuracy against exact A^π")
    args = parser.parse_args()
    per_seed = [one_seed(s) for s in range(args.seeds)]
    lines = ["| credit | MSE | ρ | continuations per step |", "|---|---:|---:|---:|"]
    for name in per_seed[0]:
        mse, rho, cost = (np.array([r[name][i] for r in per_seed]) for i in range(3))
        lines.append(
            f"| {name} | {mse.mean():.4f} ± {mse.std(ddof=1):.4f} | {rho.mean():.3f} ± {rho.std(ddof=1):.3f} | "
            f"{cost.mean():.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.results:
        body = (
            f"Synthetic layered MDPs of docs/results/estimator-accuracy.md (128 groups per seed, horizon 6, width "
            f"3, γ = 1), N = {N} rollouts per group, seeds 0–{args.seeds - 1}; mean ± std over seeds.\n\n"
            + table
        )
        write_section(Path(args.results), args.section, body)


if __name__ == "__main__":
    main()
