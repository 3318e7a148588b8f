"""Runs for loop tests: fake stage runners that write valid, deterministic tables, and a finished micro
run of the real stages (built once per test session), with what to compare two runs by."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from schemas import write_table
from schemas.atomic import atomic_dir, commit_dir
from schemas.config import Config, load_config
from schemas.integrity import CHECKPOINT_MARKER
from schemas.rundir import Run, create_run
from stages.credit.synth import synth_steps
from stages.evaluate import eval_rows, output_path
from stages.loop import run_loop
from tests.helpers.paths import CONFIGS

# fakes: each writes valid, deterministic outputs of its stage and records the call


def fake_runners(calls: list[tuple[str, int]], crash_at: tuple[str, int] | None = None):
    def rollout(run: Run, it: int, config: Config) -> None:
        calls.append(("rollout", it))
        steps = synth_steps(groups=2, group_size=3, horizon=4, seed=it, success_reward=10.0)
        run.write(it, "steps", steps.with_columns(pl.lit(it, dtype=pl.Int32).alias("iter")))

    def graph(run: Run, it: int, config: Config) -> None:
        calls.append(("graph", it))
        if crash_at == ("graph", it):
            raise RuntimeError("simulated crash")
        steps = run.read(it, "steps")
        states = pl.concat(
            [steps.select("group_id", "state"), steps.select("group_id", pl.col("next_state").alias("state"))]
        ).unique(maintain_order=True)
        nodes = states.with_columns(pl.int_range(pl.len()).over("group_id").cast(pl.Int32).alias("node"))
        run.write(
            it,
            "nodes",
            nodes.with_columns(
                visits=pl.lit(1), out_edges=pl.lit(1), ends=pl.lit(0), end_value=pl.lit(None, pl.Float64)
            ),
        )
        src = steps.join(nodes, on=["group_id", "state"], how="left")["node"]
        dst = steps.join(nodes.rename({"state": "next_state"}), on=["group_id", "next_state"], how="left")[
            "node"
        ]
        run.write(
            it, "edges", steps.select("group_id", "traj_id", "step", "reward").with_columns(src=src, dst=dst)
        )

    def solve(run: Run, it: int, config: Config) -> None:
        calls.append(("solve", it))
        nodes = run.read(it, "nodes")
        run.write(
            it,
            "values",
            nodes.select("group_id", "node").with_columns(
                value=pl.col("node").cast(pl.Float64), reaches_end=True, propagation=1, sweeps=1, residual=0.0
            ),
        )

    def advantage(run: Run, it: int, config: Config) -> None:
        calls.append(("advantage", it))
        steps = run.read(it, "steps")
        run.write(
            it,
            "advantages",
            steps.select("group_id", "traj_id", "step").with_columns(
                estimator=pl.lit("fake"),
                td=None,
                gae=None,
                advantage=pl.col("step").cast(pl.Float64),
                norm_group_size=1,
            ),  # fmt: skip
        )

    def update(run: Run, it: int, config: Config) -> None:
        calls.append(("update", it))
        run.write(
            it,
            "update",
            pl.DataFrame({"iter": [it], "epoch": [-1], "minibatch": [-1], "name": ["loss"], "value": [0.5]}),
        )
        final = run.checkpoint_dir(it)
        tmp = atomic_dir(final)
        (tmp / CHECKPOINT_MARKER).write_text("{}")
        commit_dir(tmp, final)

    def evaluate(run: Run, it: int, config: Config) -> None:
        calls.append(("eval", it))
        steps = synth_steps(groups=2, group_size=1, horizon=4, seed=100 + it, success_reward=10.0)
        name = "initial" if it < 0 else f"iter_{it:04d}"
        write_table(eval_rows(steps, 10.0, it, name), "eval", output_path(run, it))

    return {
        "rollout": rollout, "graph": graph, "solve": solve, "advantage": advantage, "update": update,
        "eval": evaluate,
    }  # fmt: skip


MICRO = [
    "run.iters=2",
    "run.eval_every=1",
    "model.tiny_hidden=32",
    "model.tiny_layers=1",
    "model.tiny_heads=2",
    "rollout.groups=2",
    "rollout.group_size=2",
    "env.max_turns=4",
    "env.train_tasks=2",
    "env.eval_tasks=2",
    "eval.group_size=1",
    "update.minibatch_size=8",
    "update.epochs=1",
]
# metric rows that measure wall-clock time, not what was computed (README: `*seconds*`, `*_per_s*`)
WALL_CLOCK = r"seconds|_per_s"
_MICRO_CACHE: dict[str, Path] = {}


def micro_config() -> Config:
    return load_config(CONFIGS / "quickstart.toml", MICRO)


def micro_run(root: Path) -> Path:
    """A finished 2-iteration micro run (built once per test session, then shared read-only)."""
    if "run" not in _MICRO_CACHE:
        import torch

        torch.set_num_threads(1)
        config = micro_config()
        run = create_run(root / "micro", config)
        run_loop(run, config, config.run.iters)
        _MICRO_CACHE["run"] = run.root
    return _MICRO_CACHE["run"]


def run_tables(root: Path) -> dict[str, pl.DataFrame]:
    out = {}
    for path in sorted(root.rglob("*.parquet")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        frame = pl.read_parquet(path)
        if "name" in frame.columns:
            frame = frame.filter(~pl.col("name").str.contains(WALL_CLOCK))
        out[str(rel)] = frame
    return out


def checkpoint_tensors(root: Path) -> dict[str, dict]:
    from safetensors.torch import load_file

    return {
        str(p.relative_to(root)): load_file(p) for p in sorted((root / "checkpoints").rglob("*.safetensors"))
    }
