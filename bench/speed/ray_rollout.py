"""Seconds per rollout iteration with the Ray executor, 1 vs 2 actors, on this machine's CPUs
(docs/results/speed.md "Ray executor: rollout with 1 vs 2 actors", docs/scaling.md "The Ray executor").

One process, one local Ray cluster, the quickstart config (8 groups x 8 rollouts, tiny model, one
torch thread per actor). Three rollout runners play iteration 0 side by side: the local executor
(``run_rollout`` in this process), a pool of 1 Ray actor and a pool of 2. Each first plays once to
warm up (Ray and actor start, torch import, engine build: what the first iteration of a loop pays),
then the iteration's outputs are deleted and played again, ``--repeats`` times, the runners taking
turns so that a background load falls on all of them alike. A time is the whole stage as the loop
sees it: the shards played, written, merged and re-read. The tables of all three are checked equal.

Ray gets 3 logical CPUs so that both pools stay warm at once (an idle actor uses no CPU; only one
runner plays at a time); ``--cores`` tells how many the machine has, for the printout only.

    python -m bench.speed.ray_rollout [--repeats 5] [--groups 8]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ray

from schemas.config import load_config
from schemas.rundir import create_run
from stages.cluster.ray_executor import RayRolloutPool, worker_runtime_env
from stages.rollout import run_rollout
from stages.warmstart.initial import ensure_initial_model

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8, help="rollout.groups (the quickstart's: 8)")
    args = parser.parse_args()

    overrides = [f"rollout.groups={args.groups}", "run.torch_threads=1"]
    config = load_config(REPO / "configs" / "quickstart.toml", overrides)
    ray.init(
        num_cpus=3, include_dashboard=False, logging_level=logging.WARNING, runtime_env=worker_runtime_env()
    )
    pools: dict[str, RayRolloutPool] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name in ("local", "ray, 1 actor", "ray, 2 actors"):
            runs[name] = create_run(Path(tmp) / name.replace(" ", "").replace(",", "-"), config)
        ensure_initial_model(runs["local"], config)
        for run in list(runs.values())[1:]:
            shutil.copytree(runs["local"].initial_model_dir, run.initial_model_dir)

        def runner(name: str):
            if name == "local":
                return lambda run, it, cfg: run_rollout(run, it, cfg, progress=False)
            workers = 1 if "1 actor" in name else 2
            cfg = load_config(
                REPO / "configs" / "quickstart.toml", [*overrides, f"cluster.rollout_workers={workers}"]
            )
            pools[name] = RayRolloutPool()
            return lambda run, it, _: pools[name](run, it, cfg)

        runners = {name: runner(name) for name in runs}
        first: dict[str, float] = {}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.repeats + 1):
            for name, run in runs.items():
                for table in ("steps.parquet", "metrics_rollout.parquet"):
                    (run.iter_dir(0) / table).unlink(missing_ok=True)
                start = time.perf_counter()
                runners[name](run, 0, config)
                seconds = time.perf_counter() - start
                if round_ == 0:
                    first[name] = seconds
                else:
                    times[name].append(seconds)
        steps = {
            name: run.read(0, "steps").drop(["response_logprobs", "choice_scores"])
            for name, run in runs.items()
        }
        same = all(frame.equals(steps["local"]) for frame in steps.values())
        for pool in pools.values():
            pool.close()
    ray.shutdown()

    load = os.getloadavg()[0]
    print(
        f"quickstart rollout iteration ({args.groups} groups x {config.rollout.group_size} rollouts, "
        f"{steps['local'].height} steps), {os.cpu_count()} cores, load average {load:.2f} at the end; "
        f"tables equal (scores aside): {same}"
    )
    print("| executor | first call s | median s | min s | runs |")
    print("|---|---|---|---|---|")
    for name in runs:
        print(
            f"| {name} | {first[name]:.2f} | {statistics.median(times[name]):.2f} | {min(times[name]):.2f} "
            f"| {len(times[name])} |"
        )
    one, two = (statistics.median(times[n]) for n in ("ray, 1 actor", "ray, 2 actors"))
    print(f"1 actor / 2 actors (median): {one / two:.2f}x")


if __name__ == "__main__":
    main()
