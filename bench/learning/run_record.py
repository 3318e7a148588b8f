"""One finished run's record, iteration by iteration, as a Markdown table for docs/results/.

    python -m bench.learning.run_record RUN [RUN ...]

For each run: a summary line (held-out success and valid-action rate of the initial policy and of
the last evaluated checkpoint, training-success AUC) and a row per iteration: training success,
valid-action rate, the update's KL to the reference (k3) and exact KL of the update on its probe
rows, the share of rows at a branching state (its rollouts went on to different next states) and of
rows with a non-zero advantage, the sampled tokens' entropy, seconds of the
rollout, the update and the whole iteration, and the engine's log-prob gap to the trainer (mean /
max). When both evaluations kept their episodes on common draws, the summary adds the draws the last
checkpoint gained and lost against the initial policy (the churn inside the difference of rates). A
long run is recorded as it finishes, so a machine that goes away takes nothing recorded with it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from bench.learning.runs import finished_iterations, overall_evaluations
from schemas import read_table
from stages.evaluate import EPISODES_FILE, draw_changes

HEADER = (
    "| iter | training success | valid-action rate | kl (k3, to reference) | policy_kl (exact, per update) "
    "| rows at a branching state | rows with A ≠ 0 | entropy | rollout s | update s | iteration s | engine gap mean / max |"
)


def overall(path: Path) -> dict[str, float]:
    """name -> value of a metrics table's overall rows (no task type)."""
    if not path.is_file():
        return {}
    table = pl.read_parquet(path)
    if "task_type" in table.columns:
        table = table.filter(pl.col("task_type").is_null())
    return dict(zip(table["name"].to_list(), table["value"].to_list(), strict=True))


def nonzero_share(path: Path) -> float:
    """Share of an iteration's rows whose advantage is not 0 (NaN when it has none)."""
    if not path.is_file():
        return float("nan")
    advantages = pl.read_parquet(path, columns=["advantage"])["advantage"]
    return float((advantages != 0).mean()) if advantages.len() else float("nan")


def branching_share(path: Path) -> float:
    """Share of an iteration's rows (graph edges) that leave a state whose rollouts did not all go to
    the same next state: the only places where a step's credit can differ from its siblings' (NaN
    without a graph)."""
    if not path.is_file():
        return float("nan")
    edges = pl.read_parquet(path, columns=["group_id", "src", "dst"])
    if edges.height == 0:
        return float("nan")
    successors = edges.group_by("group_id", "src").agg(pl.col("dst").n_unique().alias("successors"))
    return float((edges.join(successors, on=["group_id", "src"])["successors"] >= 2).mean())


def evaluations(run: Path) -> list[dict[str, float]]:
    """The run's evaluations in order (initial first, ``x`` = policy updates behind it): success,
    valid-action rate, episodes."""
    table = overall_evaluations(run)
    found = []
    for (updates,), rows in table.sort("x").group_by("x", maintain_order=True):
        values = dict(zip(rows["name"].to_list(), rows["value"].to_list(), strict=True))
        found.append({"x": float(updates), **values})
    return found


def draws_line(run: Path) -> str:
    """'draws gained / lost …' of the last evaluated checkpoint against the initial policy, paired on
    common draws; '' when either evaluation has no episodes or they are not the same draws."""
    initial = run / EPISODES_FILE
    evaluated = sorted(run.glob(f"iter_[0-9]*/{EPISODES_FILE}"))
    if not initial.is_file() or not evaluated:
        return ""
    try:
        changes = draw_changes(
            read_table(initial, "eval_episodes"), read_table(evaluated[-1], "eval_episodes")
        )
    except ValueError:  # per-iteration draws: nothing to pair
        return ""
    return (
        f" Draws against the initial policy ({changes['paired']} paired): {changes['gained']} gained, "
        f"{changes['lost']} lost ({changes['kept']} won by both, {changes['failed']} by neither)."
    )


def cell(value: float | None, digits: int) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def record(run: Path) -> str:
    """The summary line and the per-iteration table of ``run``."""
    iterations = finished_iterations(run)
    rows, successes = [HEADER, "|" + "---|" * 12], []
    for k in range(iterations):
        folder = run / f"iter_{k:04d}"
        rollout, update = (
            overall(folder / "metrics_rollout.parquet"),
            overall(folder / "metrics_update.parquet"),
        )
        loop = overall(folder / "metrics_loop.parquet")
        successes.append(rollout.get("success_rate", float("nan")))
        # the token gap of recomputed rows; where none was recomputed, the probe's choice gap
        kind = next((k for k in ("engine_logprob_gap", "engine_choice_gap") if f"{k}_mean" in update), None)
        gap = f"{update[f'{kind}_mean']:.1e} / {update[f'{kind}_max']:.2f}" if kind else "-"
        rows.append(
            f"| {k} | {cell(rollout.get('success_rate'), 3)} | {cell(rollout.get('valid_action_rate'), 3)} "
            f"| {cell(update.get('kl'), 4)} | {cell(update.get('policy_kl'), 4)} "
            f"| {cell(branching_share(folder / 'edges.parquet'), 2)} "
            f"| {cell(nonzero_share(folder / 'advantages.parquet'), 2)} | {cell(update.get('entropy'), 3)} "
            f"| {cell(loop.get('seconds_rollout'), 0)} | {cell(loop.get('seconds_update'), 0)} "
            f"| {cell(loop.get('seconds_iteration'), 0)} | {gap} |"
        )
    evals = evaluations(run)
    auc = sum(successes) / len(successes) if successes else float("nan")
    summary = f"**{run.name}** ({iterations} iterations): "
    if evals:
        first, last = evals[0], evals[-1]
        summary += (
            f"held-out initial success {first.get('success_rate', float('nan')):.3f} "
            f"(valid {first.get('valid_action_rate', float('nan')):.3f}) → after {last['x']:.0f} updates "
            f"success **{last.get('success_rate', float('nan')):.3f}** "
            f"(valid {last.get('valid_action_rate', float('nan')):.3f}, {last.get('episodes', 0):.0f} episodes); "
        )
    summary += f"training-success AUC {auc:.3f}." + draws_line(run)
    return summary + "\n\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run in parser.parse_args().runs:
        print(record(run) + "\n")


if __name__ == "__main__":
    main()
