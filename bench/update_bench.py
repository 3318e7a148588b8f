"""Update-stage throughput on CPU at quickstart size (BENCHMARKS.md "Update throughput (CPU)").

One ``run_update`` (the whole stage: reference pass, old-policy pass, optimizer steps, checkpoint)
on a synthetic iteration of 16 groups x 8 rollouts x 8 steps = 1024 rows with ~300-token prompts,
for the quickstart's tiny model (household tokenizer, hidden 64, 2 layers), one torch thread:

* ``choose`` rows: 10 admissible actions of 2-4 words each, the response is one of them;
* ``token`` rows: a generated response of ``--response-tokens`` tokens (no choices).

Update settings are configs/quickstart.toml's (lr, minibatch 64, epochs) with beta = 0.01, so the
reference pass is included. Reported: seconds per iteration, rows/s and tokens/s of the optimizer
steps (prompt + response/choice tokens through forward + backward), the phase split, and -- as a
ratio in the same run -- the optimizer steps with logits at the scored positions only
(``SelectedLogits``) against logits at every position.

    python bench/update_bench.py [--response-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from schemas import write_table
from schemas.config import load_config
from schemas.rundir import create_run
from stages.update import logprobs as update_logprobs
from stages.update.runner import run_update

REPO = Path(__file__).resolve().parents[1]
GROUPS, ROLLOUTS, STEPS = 16, 8, 8


def synthetic_iteration(tokenizer, mode: str, response_tokens: int, seed: int = 0):
    """Steps + advantages of one iteration: prompts of ~300 random vocabulary tokens."""
    rng = np.random.default_rng(seed)
    words = [w for w, i in tokenizer.get_vocab().items() if i >= 10 and w.isalpha()]
    vocab_ids = np.array([tokenizer.convert_tokens_to_ids(w) for w in words])
    rows, adv = [], []
    for g in range(GROUPS):
        for t in range(ROLLOUTS):
            for s in range(STEPS):
                prompt_ids = rng.choice(vocab_ids, size=int(rng.integers(270, 330))).tolist()
                choices = None
                if mode == "choose":
                    choices = list(
                        dict.fromkeys(
                            " ".join(rng.choice(words, size=int(rng.integers(2, 5)))) for _ in range(10)
                        )
                    )
                    response = choices[int(rng.integers(len(choices)))]
                    response_ids = tokenizer.encode(response, add_special_tokens=False)
                else:
                    response_ids = rng.choice(vocab_ids, size=response_tokens).tolist()
                    response = tokenizer.decode(response_ids)
                rows.append(
                    {
                        "iter": 0,
                        "group_id": f"g{g}",
                        "task_id": f"task{g}",
                        "task_type": "",
                        "traj_id": f"g{g}-t{t}",
                        "step": s,
                        "state": f"{g}-{t}-{s}",
                        "next_state": f"{g}-{t}-{s + 1}",
                        "observation": "",
                        "action": response,
                        "valid": True,
                        "reward": 0.0,
                        "outcome": 0.0,
                        "done": s == STEPS - 1,
                        "terminated": s == STEPS - 1,
                        "truncated": False,
                        "prompt": None,
                        "response": response,
                        "prompt_ids": prompt_ids,
                        "response_ids": response_ids,
                        "response_logprobs": None,
                        "choices": choices,
                        "policy_version": "initial",
                        "error": None,
                    }
                )
                adv.append(float(rng.normal()))
    steps = pl.DataFrame(
        rows,
        schema_overrides={
            "choices": pl.List(pl.Utf8),
            "prompt": pl.Utf8,
            "response_logprobs": pl.List(pl.Float32),
            "error": pl.Utf8,
        },
    )
    advantages = steps.select("group_id", "traj_id", "step").with_columns(
        pl.lit("graft").alias("estimator"),
        pl.lit(None, dtype=pl.Float64).alias("td"),
        pl.lit(None, dtype=pl.Float64).alias("gae"),
        pl.Series("advantage", adv),
        pl.lit(1, dtype=pl.Int32).alias("norm_group_size"),
    )
    return steps, advantages


def one_update(
    root: Path, model_dir: Path, steps: pl.DataFrame, adv: pl.DataFrame, full_logits: bool
) -> dict:
    config = load_config(
        REPO / "configs" / "quickstart.toml", ["update.beta=0.01", f'model.path="{model_dir}"']
    )
    run = create_run(root, config)
    write_table(steps, "steps", run.table_path(0, "steps"))
    write_table(adv, "advantages", run.table_path(0, "advantages"))
    update_logprobs.SelectedLogits.full_logits = full_logits
    started = time.perf_counter()
    run_update(run, 0, config)
    wall = time.perf_counter() - started
    update_logprobs.SelectedLogits.full_logits = False
    summary = run.read(0, "update").filter(pl.col("epoch") == -1)
    values = dict(zip(summary["name"].to_list(), summary["value"].to_list(), strict=True))
    train_seconds = sum(
        run.read(0, "update")
        .filter((pl.col("epoch") >= 0) & (pl.col("name") == "seconds"))["value"]
        .to_list()
    )
    return {
        "wall": wall,
        "train_s": train_seconds,
        "ref_s": values["ref_seconds"],
        "old_s": values["old_seconds"],
        "tokens_per_s": values["tokens_per_s"],
        "rows_per_s": values["rows"] * config.update.epochs / train_seconds,
        "rows": values["rows"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from stages.policy.models import load_tokenizer
    from stages.rollout import build_tiny_for_config

    config = load_config(REPO / "configs" / "quickstart.toml")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = build_tiny_for_config(tmp_path / "model", config)
        tokenizer = load_tokenizer(model_dir)
        from safetensors.torch import load_file

        n_params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        print(
            f"tiny model: hidden {config.model.tiny_hidden}, layers {config.model.tiny_layers}, "
            f"vocab {len(tokenizer)}, {n_params} parameters; {GROUPS}x{ROLLOUTS}x{STEPS} rows; lr {config.update.lr}, "
            f"minibatch {config.update.minibatch_size}, epochs {config.update.epochs}, beta 0.01"
        )
        print(
            "| mode | rows | s / iteration | optimizer rows/s | optimizer tokens/s | ref s | old s | steps s | "
            "full-logits steps s | selected speed-up |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for mode in ("choose", "token"):
            steps, adv = synthetic_iteration(tokenizer, mode, args.response_tokens)
            best: dict[str, dict] = {}
            for r in range(args.repeats):
                for full in (False, True):  # interleaved, best of repeats
                    res = one_update(tmp_path / f"{mode}-{r}-{full}", model_dir, steps, adv, full)
                    key = "full" if full else "sel"
                    if key not in best or res["wall"] < best[key]["wall"]:
                        best[key] = res
            sel, full = best["sel"], best["full"]
            print(
                f"| {mode} | {sel['rows']:.0f} | {sel['wall']:.1f} | {sel['rows_per_s']:.0f} | "
                f"{sel['tokens_per_s'] / 1000:.1f}k | {sel['ref_s']:.1f} | {sel['old_s']:.1f} | "
                f"{sel['train_s']:.1f} | {full['train_s']:.1f} | {full['train_s'] / sel['train_s']:.2f}x |"
            )


if __name__ == "__main__":
    main()
