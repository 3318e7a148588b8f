"""Update-stage fixtures: a word tokenizer over a few household texts, a tiny model directory, steps and
advantages tables of choose / generate / mixed rows, a run holding them, and hand-built update rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from schemas import write_table
from schemas.config import Config, UpdateConfig
from schemas.rundir import Run, create_run

TEXTS = [
    "You are in the middle of a room . Your task is to : put a clean apple in fridge .",
    "go to kitchen",
    "take apple from table",
    "put apple in fridge",
    "open fridge",
    "clean apple with sinkbasin",
    "look",
    "inventory",
    "Nothing happens .",
    "You arrive at the table . On the table , you see an apple .",
]
ACTIONS = TEXTS[1:8]


def make_tokenizer():
    from stages.policy.tokenizer import build_word_tokenizer

    return build_word_tokenizer(TEXTS)


def make_model_dir(path: Path, seed: int = 0) -> Path:
    from stages.policy.tiny import TinySpec, random_qwen2

    tok = make_tokenizer()
    model = random_qwen2(tok, spec=TinySpec(hidden=32, layers=1, heads=2, max_positions=512), seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def synthetic_steps(tok, mode: str, n_groups: int = 2, n_traj: int = 2, n_steps: int = 3, seed: int = 0):
    """A steps table (schema-valid) plus advantages; mode: choose | generate | mixed."""
    rng = np.random.default_rng(seed)
    rows, adv = [], []
    for g in range(n_groups):
        for t in range(n_traj):
            traj = f"g{g}-t{t}"
            for s in range(n_steps):
                prompt = TEXTS[0] + " " + " ".join(rng.choice(TEXTS[8:], size=s + 1))
                choose = mode == "choose" or (mode == "mixed" and s % 2 == 0)
                k = int(rng.integers(2, len(ACTIONS) + 1))
                choices = [str(a) for a in rng.choice(ACTIONS, size=k, replace=False)]
                action = choices[int(rng.integers(k))]
                response = action if choose else action + " <action>"
                r_ids = tok.encode(response, add_special_tokens=False)
                rows.append(
                    {
                        "iter": 0,
                        "group_id": f"g{g}",
                        "task_id": f"task{g}",
                        "task_type": "pick",
                        "traj_id": traj,
                        "step": s,
                        "state": f"{traj}:{s}",
                        "next_state": f"{traj}:{s + 1}",
                        "observation": prompt,
                        "action": action,
                        "valid": True,
                        "reward": 0.0,
                        "outcome": float(t % 2) * 10,
                        "done": s == n_steps - 1,
                        "terminated": s == n_steps - 1,
                        "truncated": False,
                        "prompt": prompt,
                        "response": response,
                        "prompt_ids": tok.encode(prompt, add_special_tokens=False),
                        "response_ids": r_ids,
                        "response_logprobs": [-1.0] * len(r_ids),
                        "choices": choices if choose else None,
                        "policy_version": "initial",
                        "error": None,
                    }
                )
                adv.append(float(rng.normal()))
    steps = pl.DataFrame(rows, schema_overrides={"choices": pl.List(pl.Utf8)})
    advantages = steps.select("group_id", "traj_id", "step").with_columns(
        pl.lit("graft").alias("estimator"),
        pl.lit(None, dtype=pl.Float64).alias("td"),
        pl.lit(None, dtype=pl.Float64).alias("gae"),
        pl.Series("advantage", adv),
        pl.lit(1, dtype=pl.Int32).alias("norm_group_size"),
    )
    return steps, advantages


def make_run(root: Path, mode: str = "choose", iteration: int = 0, **update) -> tuple[Run, Config]:
    config = Config()
    config.rollout.engine = "vllm" if mode != "choose" else "hf"
    config.update = UpdateConfig(
        **{"lr": 3e-3, "minibatch_size": 5, "epochs": 2, "beta": 0.05, "max_tokens_per_batch": 256, **update}
    )
    run = create_run(root, config)
    make_model_dir(run.initial_model_dir)
    steps, adv = synthetic_steps(make_tokenizer(), mode)
    write_table(steps, "steps", run.table_path(iteration, "steps"))
    write_table(adv, "advantages", run.table_path(iteration, "advantages"))
    return run, config


def reuse_rows(run: Run, iteration: int) -> None:
    """Iteration 0's steps and advantages as ``iteration``'s (the next update trains on the same rows)."""
    for table in ("steps", "advantages"):
        write_table(run.read(0, table), table, run.table_path(iteration, table))


def update_values(run: Run, iteration: int = 0) -> dict[tuple[int, int, str], float]:
    t = run.read(iteration, "update")
    return {(e, m, n): v for e, m, n, v in t.select("epoch", "minibatch", "name", "value").iter_rows()}


def rows_for(prompts, responses, advantages, choices=None):
    from stages.update.batching import UpdateRows

    n = len(prompts)
    keys = pl.DataFrame({"group_id": ["g"] * n, "traj_id": [f"t{i}" for i in range(n)], "step": [0] * n})
    chosen = np.full(n, -1)
    choice_ids = [None] * n
    if choices is not None:
        for i, cs in enumerate(choices):
            choice_ids[i] = [np.asarray(c) for c in cs]
            chosen[i] = next(j for j, c in enumerate(cs) if list(c) == list(responses[i]))
    return UpdateRows(
        keys=keys,
        prompt_ids=[np.asarray(p) for p in prompts],
        response_ids=[np.asarray(r) for r in responses],
        advantage=np.asarray(advantages, dtype=np.float64),
        behaviour_logprobs=[None] * n,
        choices=choice_ids,
        chosen=chosen,
    )
