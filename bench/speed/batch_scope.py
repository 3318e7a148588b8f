"""Seconds per rollout iteration with ``rollout.batch_scope = "all"`` vs ``"group"`` (docs/results/speed.md
"Rollout: batch scope", docs/scaling.md "Same tables as a local run").

``"group"`` batches a turn's policy calls per group, so the log-probs' float bits do not depend on
which groups share a process (byte-identical steps under ``--shard`` and the Ray executor); the
price is smaller batches. One process plays iteration 0 of a config with both scopes, taking turns
``--repeats`` times after one warm-up each (a background load falls on both alike), and checks that
the steps tables are equal but for the scores (``response_logprobs``, ``choice_scores``).

    python -m bench.speed.batch_scope [--repeats 3] [--config configs/quickstart.toml] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from schemas.config import load_config
from schemas.rundir import create_run
from stages.rollout import run_rollout
from stages.warmstart.initial import ensure_initial_model

REPO = Path(__file__).resolve().parents[2]

SCOPES = ("all", "group")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    configs = {
        scope: load_config(args.config, [*args.overrides, f"rollout.batch_scope={scope}"]) for scope in SCOPES
    }
    times: dict[str, list[float]] = {scope: [] for scope in SCOPES}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {scope: create_run(Path(tmp) / scope, configs[scope]) for scope in SCOPES}
        ensure_initial_model(runs["all"], configs["all"])
        shutil.copytree(runs["all"].initial_model_dir, runs["group"].initial_model_dir)
        for round_ in range(args.repeats + 1):
            for scope, run in runs.items():
                for table in ("steps.parquet", "metrics_rollout.parquet"):
                    (run.iter_dir(0) / table).unlink(missing_ok=True)
                start = time.perf_counter()
                run_rollout(run, 0, configs[scope], progress=False)
                if round_:
                    times[scope].append(time.perf_counter() - start)
        steps = {scope: run.read(0, "steps") for scope, run in runs.items()}
    same = (
        steps["all"]
        .drop(["response_logprobs", "choice_scores"])
        .equals(steps["group"].drop(["response_logprobs", "choice_scores"]))
    )
    rollout = configs["all"].rollout
    print(
        f"`{Path(args.config).name}`{' with ' + ' '.join(args.overrides) if args.overrides else ''}: "
        f"{rollout.mode} mode, {rollout.groups} groups x {rollout.group_size} rollouts, batch_size "
        f"{rollout.batch_size}, {steps['all'].height} steps; {os.cpu_count()} cores, 1 torch thread, "
        f"load average {os.getloadavg()[0]:.2f} at the end; tables equal but for the scores: {same}"
    )
    print("| batch_scope | median s | min s | runs |")
    print("|---|---|---|---|")
    for scope in SCOPES:
        print(
            f"| {scope} | {statistics.median(times[scope]):.2f} | {min(times[scope]):.2f} | {args.repeats} |"
        )
    ratio = statistics.median(times["group"]) / statistics.median(times["all"])
    print(f"group / all (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
