"""Rollout speed of a preset on vLLM's CPU backend under two or more values of one engine option, side
by side in one run (docs/results/real-model-speed.md).

Plays the same rollout iteration (same tasks, same per-row seeds, same weights, a fresh engine each
time) once per value of ``rollout.engine_options.<option>``, alternating the values for ``--repeats``
rounds (so a machine that slows down in the middle slows every value), and splits each iteration's
wall time into the engine's start, time inside the engine's ``generate`` (prefill + decode: vLLM
schedules both in the same steps) and everything outside it (environment, prompt rendering,
tokenizing, parsing). It also counts the prompt tokens vLLM took from its prefix cache instead of
computing them. Prints one JSON line per rollout and a summary: episodes per minute per value, each
value's ratio to the first, and how often each value sampled the same first-turn response as the
first (same prompt, same seed).

    VLLM_CPU_KVCACHE_SPACE=2 python -m bench.speed.rollout_options \\
        --config configs/cpu/household_smollm2_headroom.toml --model RUN/sft/model \\
        --option block_size --values 128 32 [--set rollout.groups=1]
    ... --values cpu_cores=auto,block_size=128 cpu_cores=all,block_size=32   (several options at once)

``bench.speed.rollout_precision`` (dtype float32 / bfloat16) and ``bench.speed.rollout_cores``
(cpu_cores auto / all) are this comparison with their option fixed. Needs the ``vllm-cpu`` extra; the
summary names the CPU (/proc/cpuinfo's model and its native bf16 flags, stages/policy/cpu_precision.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import stages  # noqa: F401  (first: hides torch extensions built for another torch)
from schemas.config import Config, load_config
from stages.policy import live_engine as live
from stages.policy.cpu_precision import cpu_precision
from stages.rollout.runner import rollout_iteration


def timed_rollout(config: Config, model: Path, iteration: int) -> tuple[dict[str, Any], list[str]]:
    """One rollout iteration with a fresh engine: seconds to start, inside generate, and in all; the
    prompt tokens served from vLLM's prefix cache; the first-turn responses, by trajectory."""
    live.close_engines()
    start = time.perf_counter()
    engine = live.live_engine(config, model, "initial")
    started = time.perf_counter() - start
    inside = [0.0]
    generate = engine.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
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
    sent = getattr(engine, "prompt_tokens", 0)
    row = {
        "dtype": engine.dtype(),
        "episodes": episodes,
        "turns": steps.height,
        "generated_tokens": tokens,
        "prompt_tokens": int(steps["prompt_ids"].list.len().sum()),
        "prompt_tokens_cached_share": round(getattr(engine, "cached_prompt_tokens", 0) / sent, 3)
        if sent
        else None,
        "valid": round(float(steps["valid"].mean()), 3),
        "seconds_engine_start": round(started, 1),
        "seconds_play": round(play, 1),
        "seconds_in_generate": round(inside[0], 1),
        "seconds_outside_engine": round(play - inside[0], 1),
        "episodes_per_minute": round(episodes / play * 60, 2),
        "generated_tokens_per_s": round(tokens / inside[0], 1),
    }
    first = steps.filter(steps["step"] == 0).sort("traj_id")  # same prompts and seeds for every value
    return row, first["response"].to_list()


def engine_settings(option: str | None, value: str) -> list[str]:
    """``--set`` items for one compared value: ``option=value``, or with no option a value that names
    several engine options itself (``cpu_cores=all,block_size=32``)."""
    if option is not None:
        return [f"rollout.engine_options.{option}={value}"]
    return [f"rollout.engine_options.{item.strip()}" for item in value.split(",") if item.strip()]


def compare(
    config_path: str,
    model: Path,
    option: str | None,
    values: Sequence[str],
    *,
    repeats: int = 1,
    iteration: int = 0,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """Play the iteration under each value (``values[0]`` is the baseline); print every row and return
    the summary (also printed)."""
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in values}
    responses: dict[str, list[str]] = {}
    for _ in range(repeats):
        for value in values:
            config = load_config(config_path, [*extra, *engine_settings(option, value)])
            row, texts = timed_rollout(config, model, iteration)
            row = {option or "engine_options": value, **row}
            responses.setdefault(value, texts)
            rows[value].append(row)
            print(json.dumps(row), flush=True)
    live.close_engines()
    best = {v: max(r["episodes_per_minute"] for r in rs) for v, rs in rows.items()}
    base = responses[values[0]]
    summary = {
        "cpu": cpu_precision().describe(),
        "option": option,
        "best_episodes_per_minute": best,
        "over_first": {v: round(best[v] / best[values[0]], 2) for v in values[1:]},
        "same_first_turn_response_share": {
            v: sum(x == y for x, y in zip(base, responses[v], strict=True)) / max(len(base), 1)
            if len(responses[v]) == len(base)
            else None
            for v in values[1:]
        },
    }
    print(json.dumps(summary), flush=True)
    return summary


def parser(description: str, repeats: int = 1) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True)
    p.add_argument("--model", required=True, help="the weights to act with (e.g. a run's sft/model)")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("--set", dest="extra", action="append", default=[])
    return p


def main_with(option: str, values: Sequence[str], description: str, repeats: int = 1) -> None:
    """The command line of a bench that compares ``values`` of one fixed ``option``."""
    args = parser(description, repeats=repeats).parse_args()
    compare(
        args.config,
        Path(args.model),
        option,
        values,
        repeats=args.repeats,
        iteration=args.iteration,
        extra=args.extra,
    )


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--option",
        help="a key of rollout.engine_options (e.g. block_size); without it each value "
        "names its options: cpu_cores=auto,block_size=128",
    )
    p.add_argument("--values", nargs="+", required=True, help="its values as TOML; the first is the baseline")
    args = p.parse_args()
    compare(
        args.config,
        Path(args.model),
        args.option,
        args.values,
        repeats=args.repeats,
        iteration=args.iteration,
        extra=args.extra,
    )


if __name__ == "__main__":
    main()
