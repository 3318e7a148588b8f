"""Rollout speed on vLLM's CPU backend by how the model worker's threads take the cores, side by side
in one run (docs/results/real-model-speed.md).

vLLM's own binding (``rollout.engine_options.cpu_cores = "auto"``) keeps one core per worker for its
scheduler process on x86, so on 2 cores the model computes on one; ``"all"`` gives the worker's
OpenMP threads every core and lets the scheduler share one. The same rollout iteration (same tasks,
same per-row seeds, same weights, a fresh engine each time) is played once per setting, alternating
for ``--repeats`` rounds; one JSON line per rollout (bench/speed/rollout_precision.py's fields) and a
summary: episodes per minute per setting, their ratio, and how often the two sampled the same
first-turn response.

    VLLM_CPU_KVCACHE_SPACE=2 python -m bench.speed.rollout_cores \\
        --config configs/cpu/household_smollm2_headroom.toml --model RUN/sft/model [--set rollout.groups=1]

Needs the ``vllm-cpu`` extra; the summary names the CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import stages  # noqa: F401  (first: hides torch extensions built for another torch)
from bench.speed.rollout_precision import timed_rollout
from schemas.config import load_config
from stages.policy import live_engine as live
from stages.policy.cpu_precision import cpu_precision

SETTINGS = ("auto", "all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True, help="the weights to act with (e.g. a run's sft/model)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--set", dest="extra", action="append", default=[])
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {cores: [] for cores in SETTINGS}
    responses: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for cores in SETTINGS:
            config = load_config(args.config, [*args.extra, f"rollout.engine_options.cpu_cores={cores}"])
            row, texts = timed_rollout(config, Path(args.model), args.iteration)
            row = {"cpu_cores": cores, **row}
            responses.setdefault(cores, texts)
            rows[cores].append(row)
            print(json.dumps(row), flush=True)
    live.close_engines()
    best = {cores: max(r["episodes_per_minute"] for r in rs) for cores, rs in rows.items()}
    a, b = responses["auto"], responses["all"]
    same = sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1) if len(a) == len(b) else None
    print(
        json.dumps(
            {
                "cpu": cpu_precision().describe(),
                "best_episodes_per_minute": best,
                "all_over_auto": round(best["all"] / best["auto"], 2),
                "same_response_share": same,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
