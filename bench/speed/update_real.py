"""The update of a real pretrained model on CPU: SmolLM2-135M-Instruct, seconds per iteration and
model FLOPs utilization, before and after the CPU settings (docs/results/update-speed.md).

Rows: generate-mode turns of the household world as the real-model preset plays them
(configs/cpu/household_smollm2.toml: SmolLM2's chat template, history 2, the ``plan`` thinking text),
taken from noisy expert demos so that no rollout is needed and rows are distinct as sampled ones are --
``--rows`` rows (~330 prompt + ~41 response tokens each), random advantages (seeded).
One update iteration = the passes the update stage runs on such rows when vLLM acted (so the old
log-probs are recomputed) in an iteration after the first (so the reference pass runs): reference
pass, old-policy pass, ``update.epochs`` passes of optimizer steps. Each setting is timed in the same
process, interleaved with the others, best of ``--repeats``:

* ``before``: the preset as it was -- float32, LoRA r = 16 on every linear layer, gradient
  checkpointing, old log-probs recomputed;
* ``no-ckpt``: the same without gradient checkpointing;
* ``bf16``: + bf16 autocast on CPU (``update.bf16_on_cpu``);
* ``bf16-top8``: + adapters on the last 8 of 30 decoder layers (``update.lora.layers = 8``);
* ``after``: + the first step's old log-probs from its own forward (``update.old_logprobs = forward``:
  the first minibatch's rows skip the old-policy pass; with one minibatch of every row it is gone);
* ``shared-trunk``: + the trunk once per row (``update.shared_trunk``): the 22 frozen layers below the
  adapters run once per row, in the reference pass, and the old pass and the optimizer steps run only
  the top 8 layers over their output;
* ``f32-after``, ``f32-shared-trunk``: ``after`` and ``shared-trunk`` in float32 -- the update a
  ``"native"`` preset runs on a CPU without native bf16 (no AMX, no AVX-512 BF16), where bf16
  autocast would only emulate bf16.

``--minibatch M`` splits the rows into minibatches of M (the headroom preset: 64), as the update does:
the rows outside the first minibatch then take the old-policy pass.

Model FLOPs of the optimizer steps (fwd + bwd), per token of a row: forward 2·N_body + attention
4·L·d·(t + 1)/2 summed over positions t (causal), the head 2·V·d at response positions only (graft
scores only those); backward 2× the forward of what the gradient flows through: every layer for LoRA
on all layers (activation gradients; the adapters' own weight gradients are negligible), the last K
layers and the head for ``lora.layers = K``. Gradient checkpointing's recomputation is not counted
(it is waste, not model FLOPs). MFU = model FLOPs / seconds / peak, the peak being this machine's
own matmul throughput in the setting's dtype, measured in the same run on the model's largest
linear shape (tokens × 576 @ 576 × 1536). ``--write`` records the table in docs/results.

    python -m bench.speed.update_real --model models/smollm2 [--rows 96] [--repeats 2] [--write]
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from schemas.config import LoraConfig, UpdateConfig
from stages.envs.registry import make_env
from stages.play.collect import model_inputs
from stages.policy.cpu_precision import cpu_precision
from stages.update.batching import UpdateRows
from stages.update.distributed import DistContext
from stages.update.lora import peft_config
from stages.update.trainer import score_all_rows, train_policy
from stages.warmstart.demos import expert_demos

ROOM = {
    "shuffle": False,
    "receptacles": 3,
    "distractors": 0,
    "info_actions": False,
    "task_types": ["pick_and_place_simple", "pick_heat_then_place_in_recep"],
}


@dataclass(frozen=True)
class Setting:
    name: str
    bf16_on_cpu: bool
    layers: int  # 0 = every decoder layer
    checkpointing: bool
    old_from_forward: bool
    shared_trunk: bool = False


SETTINGS = (
    Setting("before", False, 0, True, False),
    Setting("no-ckpt", False, 0, False, False),
    Setting("bf16", True, 0, False, False),
    Setting("bf16-top8", True, 8, False, False),
    Setting("after", True, 8, False, True),
    Setting("shared-trunk", True, 8, False, True, shared_trunk=True),
    Setting("f32-after", False, 8, False, True),
    Setting("f32-shared-trunk", False, 8, False, True, shared_trunk=True),
)


def household_rows(tokenizer, n_rows: int, seed: int = 0) -> UpdateRows:
    """``n_rows`` generate-mode rows: demo turns with the chat template, random advantages."""
    import polars as pl

    env = make_env("household", max_turns=8, invalid_penalty=-0.1, **ROOM)
    # noisy episodes (half the turns random, labelled as played): a noise-free expert repeats itself,
    # and the no-grad passes score a repeated row once, which RL's sampled rows rarely allow
    tasks = env.tasks("train", n_rows, seed)
    demos = expert_demos(
        env, tasks, n_rows, noise=0.5, keep_noise=1.0, seed=seed, history_length=2, think="plan"
    ).head(n_rows)
    _, prompts, _ = model_inputs(tokenizer, True, demos["prompt"].to_list(), 1024)
    responses = tokenizer(demos["response"].to_list(), add_special_tokens=False)["input_ids"]
    n = len(prompts)
    rng = np.random.default_rng(seed)
    keys = pl.DataFrame({"group_id": ["g"] * n, "traj_id": [f"t{i}" for i in range(n)], "step": [0] * n})
    return UpdateRows(
        keys=keys,
        prompt_ids=[np.asarray(p) for p in prompts],
        response_ids=[np.asarray(r) for r in responses],
        advantage=rng.standard_normal(n),
        behaviour_logprobs=[None] * n,
        choices=[None] * n,
        chosen=np.full(n, -1),
    )


def matmul_peak(dtype: torch.dtype, tokens: int = 4096, repeats: int = 10) -> float:
    """FLOP/s of ``tokens`` × 576 @ 576 × 1536 (SmolLM2's MLP shape) in ``dtype``, best of ``repeats``."""
    x = torch.randn(tokens, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 2):
        start = time.perf_counter()
        x @ w.T
        best = min(best, time.perf_counter() - start)
    return 2 * tokens * 576 * 1536 / best


def train_flops(
    model: torch.nn.Module, rows: UpdateRows, grad_layers: int, forward_layers: int | None = None
) -> float:
    """Model FLOPs of one forward + backward over every row (module docstring). ``forward_layers``:
    the decoder layers the optimizer steps' forward runs (all by default; the top K with the trunk
    once per row, whose cached trunk is computed in the reference pass, not here)."""
    config = model.config
    layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    embed = vocab * hidden
    body = sum(p.numel() for p in model.parameters()) - embed  # tied head: the embedding counted once
    per_layer = body / layers
    total = 0.0
    for prompt, response in zip(rows.prompt_ids, rows.response_ids, strict=True):
        length = len(prompt) + len(response)
        attention = 4 * layers * hidden * length * (length + 1) / 2  # QK^T and AV, causal, all positions
        ran = (forward_layers or layers) / layers
        forward = ran * (2 * body * length + attention) + 2 * embed * len(response)
        share = grad_layers / layers
        backward = 2 * (2 * per_layer * grad_layers * length + attention * share + 2 * embed * len(response))
        total += forward + backward
    return total


def load_policy(model_dir: Path, setting: Setting) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the trained model with fresh adapters, the frozen reference) for ``setting``."""
    from peft import get_peft_model

    from stages.update.checkpoint import enable_gradient_checkpointing, load_model

    base = load_model(model_dir).eval()
    reference = copy.deepcopy(base).requires_grad_(False)
    torch.manual_seed(0)
    peft_model = get_peft_model(base, peft_config(LoraConfig(r=16, alpha=32.0, layers=setting.layers), base))
    model = peft_model.get_base_model().eval()
    if setting.checkpointing:
        enable_gradient_checkpointing(model)
    return model, reference


def one_iteration(
    model_dir: Path, rows: UpdateRows, setting: Setting, threads: int, minibatch: int
) -> dict[str, float]:
    """Seconds of the reference pass, the old pass and the optimizer steps of one update iteration."""
    from stages.update.shared_trunk import TrunkCache, join, leave
    from stages.update.trainer import first_minibatch

    torch.set_num_threads(threads)
    model, reference = load_policy(model_dir, setting)
    cfg = UpdateConfig(
        lr=2e-5,
        minibatch_size=min(minibatch, rows.n),
        epochs=1,
        beta=0.01,
        max_tokens_per_batch=4096,
        bf16_on_cpu=setting.bf16_on_cpu,
        gradient_checkpointing=setting.checkpointing,
        lora=LoraConfig(r=16, alpha=32.0, layers=setting.layers),
    )
    ctx = DistContext()
    trunk = TrunkCache(setting.layers) if setting.shared_trunk else None
    t0 = time.perf_counter()
    if trunk is not None and not join(reference, trunk):
        raise SystemExit("shared-trunk: the reference could not join the trunk cache")
    ref = score_all_rows(
        reference, rows, 1.0, cfg.max_tokens_per_batch, ctx, as_tokens=True, bf16_on_cpu=setting.bf16_on_cpu
    ).tokens
    leave(reference)
    if trunk is not None and not join(model, trunk):
        raise SystemExit("shared-trunk: the policy could not join the trunk cache")
    t1 = time.perf_counter()
    rng = np.random.default_rng(0)
    first = first_minibatch(rows.n, cfg, rng) if setting.old_from_forward else None
    skip = first if first is not None else np.zeros(0, dtype=np.int64)
    old = score_all_rows(
        model,
        rows,
        1.0,
        cfg.max_tokens_per_batch,
        ctx,
        only=np.setdiff1d(np.arange(rows.n), skip),
        bf16_on_cpu=setting.bf16_on_cpu,
    )
    t2 = time.perf_counter()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    result = train_policy(model, rows, old, ref, cfg, 1.0, rng, ctx, optimizer, old_from_forward=first)
    t3 = time.perf_counter()
    loss = result.steps[0][2]["loss"]
    return {"ref": t1 - t0, "old": t2 - t1, "train": t3 - t2, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--minibatch", type=int, default=0, help="rows per minibatch (0 = every row)")
    parser.add_argument("--settings", nargs="*", default=[s.name for s in SETTINGS])
    parser.add_argument("--write", action="store_true", help="record the table in docs/results")
    args = parser.parse_args()

    from stages.policy.models import load_tokenizer
    from stages.update.checkpoint import load_model

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    rows = household_rows(tokenizer, args.rows)
    tokens = int(sum(len(p) + len(r) for p, r in zip(rows.prompt_ids, rows.response_ids, strict=True)))
    response_tokens = int(rows.response_lengths.sum())
    probe = load_model(args.model)
    layers = probe.config.num_hidden_layers
    peaks = {False: matmul_peak(torch.float32), True: matmul_peak(torch.bfloat16)}
    chosen = [s for s in SETTINGS if s.name in args.settings]
    best: dict[str, dict[str, float]] = {}
    for repeat in range(args.repeats):
        for setting in chosen:
            times = one_iteration(args.model, rows, setting, args.threads, args.minibatch or rows.n)
            times["total"] = times["ref"] + times["old"] + times["train"]
            print(
                f"repeat {repeat} {setting.name}: " + " ".join(f"{k} {v:.2f}" for k, v in times.items()),
                flush=True,
            )
            if setting.name not in best or times["total"] < best[setting.name]["total"]:
                best[setting.name] = times
    peaks = {
        False: max(peaks[False], matmul_peak(torch.float32)),
        True: max(peaks[True], matmul_peak(torch.bfloat16)),
    }
    header = (
        "| setting | reference pass s | old pass s | optimizer steps s | update s | train tokens/s | "
        "model FLOPs/s (G) | MFU (own dtype's matmul peak) | loss |"
    )
    lines = [header, "|" + "---|" * 9]
    for setting in chosen:
        t = best[setting.name]
        flops = train_flops(
            probe, rows, setting.layers or layers, setting.layers if setting.shared_trunk else None
        )
        rate = flops / t["train"]
        lines.append(
            f"| {setting.name} | {t['ref']:.1f} | {t['old']:.1f} | {t['train']:.1f} | {t['total']:.1f} | "
            f"{tokens / t['train']:.0f} | {rate / 1e9:.1f} | {rate / peaks[setting.bf16_on_cpu]:.2f} | "
            f"{t['loss']:.5f} |"
        )
    table = "\n".join(lines)
    summary = (
        f"{cpu_precision().describe()}; {rows.n} rows, {tokens} tokens ({response_tokens} response tokens), {args.threads} threads; "
        f"matmul peak here: float32 {peaks[False] / 1e9:.0f} GFLOP/s, bfloat16 {peaks[True] / 1e9:.0f} GFLOP/s"
    )
    print(summary)
    print(table)
    if args.write:
        from bench.section_writer import write_section

        ratios = [
            f"{a} → {b}: {best[a]['total'] / best[b]['total']:.2f}× less time per update iteration"
            for a, b in (
                ("before", "after"),
                ("after", "shared-trunk"),
                ("f32-after", "after"),
                ("f32-after", "f32-shared-trunk"),
            )
            if a in best and b in best
        ]
        names = [s.name for s in chosen]
        title = "SmolLM2-135M update on CPU: before and after"
        if names != [s.name for s in SETTINGS] or args.minibatch:
            title = (
                f"SmolLM2-135M update on CPU: {', '.join(names)}, minibatches of {args.minibatch or rows.n}"
            )
        write_section(
            Path("docs/results/update-speed.md"),
            title,
            f"{summary}. Best of {args.repeats} interleaved repeats; the update iteration is the reference "
            f"pass + the old pass + the optimizer steps (minibatches of {args.minibatch or rows.n} rows, "
            f"one epoch).\n\n{table}\n\n" + "; ".join(ratios or ["no pair of settings to compare"]) + ".",
        )


if __name__ == "__main__":
    main()
