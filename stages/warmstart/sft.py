"""Warm start (docs/design.md §6): behaviour cloning of expert demos, the CPU analogue of an instruct model.

The paper's policy starts as an instruct model that already writes ``<think>…</think><action>…</action>``;
the tiny random model writes nothing parseable. The warm start clones the scripted expert (optionally
ε-noisy, ``stages.warmstart.demos``) so that generate-mode RL starts with a low invalid rate and partial
success:

    loss(θ) = − (1 / Σ_rows |y_row|) Σ_rows Σ_{j} log π_θ(y_row,j | x_row, y_row,<j)

x = the model input of the demo's prompt, built exactly as the rollout builds it
(``stages.play.collect.model_inputs``), y = the tokens of the demo response; the prompt tokens
carry no loss (token-mean over the response tokens of a minibatch). AdamW, gradient clipping,
minibatches of whole rows in a seeded order (seed ``(run.seed, "sft")``), ``sft.epochs`` passes.

Run layout: ``<run>/sft/demos/steps.parquet`` (the demos), ``<run>/sft/update.parquet`` (table
``update``, iter -1: the loss of every optimizer step), ``<run>/sft/metrics_sft.parquet`` (table
``metrics``: demo success, steps, first and last loss) and ``<run>/sft/model/`` (the checkpoint: the
run's initial policy and KL reference). The stage is complete when the checkpoint is; a warm start
killed midway is redone from the start, which gives identical weights (CPU, same seed and threads).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from schemas import read_table, write_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.integrity import checkpoint_complete
from schemas.metrics import metrics_frame
from schemas.rundir import Run
from stages.envs.parser import parse_response
from stages.observe.progress import terminal_progress
from stages.play.collect import CHOOSE_PREFIX, model_inputs
from stages.policy.live_engine import live_engine
from stages.policy.sampling import derive_rng
from stages.update.batching import minibatch_schedule
from stages.update.trainer import bf16_autocast
from stages.warmstart.dagger import dagger_round, dagger_settings
from stages.warmstart.demos import demo_summary, make_demo_environment, split_demos, split_tasks

SFT_ITER = -1  # the warm start runs before iteration 0
IGNORE = -100  # label of tokens that carry no loss (Hugging Face's convention)
ACTION_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class Example:
    """One demo turn as token ids: the model input and the response to clone."""

    prompt_ids: list[int]
    response_ids: list[int]


def sft_examples(
    steps: pl.DataFrame, tokenizer, chat: bool, max_prompt_tokens: int, choose_style: str | None = None
) -> tuple[list[Example], int]:
    """The (input, response) token ids of every demo row, and how many prompts were cut.

    ``choose_style`` (the environment's prompt style, for a run in choose mode): the input ends with
    choose mode's action tag and the response is the demo's action alone, tokenized as choose mode
    tokenizes an admissible action (``stages.play.collect``), so the warm start clones the choice the
    rollout scores, not a ``<think>`` text the policy never writes there.
    """
    if steps.height == 0:
        raise GraftError("sft: the demos table has no rows")
    if steps["prompt"].null_count() or steps["response"].null_count():
        raise GraftError("sft: every demos row needs a prompt and a response (write them with graft demos)")
    responses, suffix = steps["response"].to_list(), ""
    if choose_style is not None:
        labels = [_raw_action(choose_style, text) for text in responses]
        missing = next((i for i, label in enumerate(labels) if not label), None)
        if missing is not None:
            raise GraftError(
                f"sft: demos row {missing} has no action to clone in choose mode: {responses[missing]!r}"
            )
        responses, suffix = labels, CHOOSE_PREFIX
    _, prompt_ids, cut = model_inputs(tokenizer, chat, steps["prompt"].to_list(), max_prompt_tokens, suffix)
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    examples = [Example(p, list(r)) for p, r in zip(prompt_ids, response_ids, strict=True)]
    return examples, cut


def _raw_action(style: str, response: str) -> str | None:
    """The action a demo response names, as the admissible action it was written from: the parser's
    action (``stages.envs.parser``) matched back to the response's own spelling (the parser
    lower-cases; an admissible action keeps its case)."""
    action = parse_response(style, response)
    if action is None:
        return None
    for written in reversed(ACTION_TAG.findall(response)):
        if " ".join(written.lower().split()) == action:
            return " ".join(written.split())
    return action


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (``IGNORE`` on prompt and padding) [B, L]."""
    width = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n_prompt, n = len(e.prompt_ids), len(e.prompt_ids) + len(e.response_ids)
        ids[i, :n] = torch.tensor(e.prompt_ids + e.response_ids)
        labels[i, n_prompt:n] = torch.tensor(e.response_ids)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def response_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(Σ cross-entropy over the response tokens, their count): logits are computed only at the
    positions that predict a response token (the language-model head over every position dominates
    memory for a real vocabulary: 49k-150k columns), through the update's ``SelectedLogits``."""
    from stages.update.logprobs import as_scorer

    labels = batch["labels"]
    rows, positions = torch.nonzero(labels[:, 1:] != IGNORE, as_tuple=True)  # position t predicts t + 1
    targets = labels[:, 1:][rows, positions]
    scorer = as_scorer(model)
    device = next(scorer.parameters()).device
    logits = scorer(
        batch["input_ids"].to(device),
        batch["attention_mask"].to(device),
        None,
        rows.to(device),
        positions.to(device),
    ).float()
    return torch.nn.functional.cross_entropy(logits, targets.to(device), reduction="sum"), int(
        targets.numel()
    )


def response_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean cross-entropy of the response tokens (the module docstring's loss), a scalar."""
    total, count = response_token_loss(model, batch)
    return total / max(count, 1)


def micro_batches(examples: Sequence[Example], rows: np.ndarray, max_tokens: int) -> list[list[int]]:
    """``rows`` cut in order into micro-batches whose padded size (rows x longest sequence) stays within
    ``max_tokens`` (a single longer row is a micro-batch of its own)."""
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in rows.tolist():
        length = len(examples[i].prompt_ids) + len(examples[i].response_ids)
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        out.append(current)
    return out


def sft_lr(config: Config) -> float:
    """``sft.lr``, or when it is 0 (auto) the default for the kind of model: 3e-3 for the tiny model
    trained from scratch, 5e-5 for a pretrained one (3e-3 wrecks SmolLM2-135M-Instruct; 5e-5 cloned it)."""
    if config.sft.lr > 0:
        return config.sft.lr
    return TINY_SFT_LR if not config.model.path else PRETRAINED_SFT_LR


TINY_SFT_LR = 3e-3
PRETRAINED_SFT_LR = 5e-5


def lr_factor(step: int, total: int, schedule: str, warmup_steps: int) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based) of a phase of
    ``total`` steps: a linear warm-up over the first ``warmup_steps`` steps ((step + 1) / warmup),
    then 1 (``constant``) or a half cosine from 1 down to 0 over the remaining steps (``cosine``:
    0.5 (1 + cos(π s / S)) with s the steps since the warm-up and S their count, so the last step
    trains at a small but non-zero rate)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise GraftError(f"sft: unknown lr schedule '{schedule}' (constant, cosine)")
    span = max(1, total - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / span))


def train_sft(
    model: torch.nn.Module,
    examples: Sequence[Example],
    pad_id: int,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    rng: np.random.Generator,
    grad_clip: float = 1.0,
    lr_schedule: str = "constant",
    warmup_steps: int = 0,
    max_tokens: int = 1 << 30,
    bf16: bool = True,
    bf16_on_cpu: bool | str = False,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Clone ``examples`` into ``model`` (in place, on the device it is on); return the loss of every
    optimizer step.

    The learning rate of step ``t`` is ``lr * lr_factor(t, steps, lr_schedule, warmup_steps)``. A
    minibatch is split into micro-batches of at most ``max_tokens`` padded tokens whose gradients add
    up to the minibatch's token-mean loss (the same step as one pass); bf16 autocast on a GPU (and on
    the CPU with ``bf16_on_cpu``). Only parameters that require a gradient train (LoRA: the adapters)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    schedule = minibatch_schedule(len(examples), batch_size, epochs, rng)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, len(schedule), lr_schedule, warmup_steps)
    )
    device = next(model.parameters()).device
    model.train()
    losses = []
    for step, rows in enumerate(schedule):
        optimizer.zero_grad(set_to_none=True)
        parts = micro_batches(examples, rows, max_tokens)
        total_tokens = sum(len(examples[i].response_ids) for i in rows)
        step_loss = 0.0
        for part in parts:
            with bf16_autocast(device, bf16, bf16_on_cpu):
                loss_sum, _ = response_token_loss(model, collate([examples[i] for i in part], pad_id))
            loss = loss_sum / max(total_tokens, 1)
            if not torch.isfinite(loss):
                raise GraftError(f"sft: the loss became {loss.item()} at step {step} (lower sft.lr)")
            loss.backward()
            step_loss += float(loss.item())
        torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(step_loss)
        if on_step is not None:
            on_step(step + 1, len(schedule), losses[-1])
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------
# the stage


def sft_update_table(losses: Sequence[float], steps_per_epoch: int, first_epoch: int = 0) -> pl.DataFrame:
    """Table ``update`` (iter -1) of one training phase: its losses, epochs numbered from ``first_epoch``."""
    n = len(losses)
    return pl.DataFrame(
        {
            "iter": pl.Series([SFT_ITER] * n, dtype=pl.Int32),
            "epoch": pl.Series([first_epoch + i // steps_per_epoch for i in range(n)], dtype=pl.Int32),
            "minibatch": pl.Series([i % steps_per_epoch for i in range(n)], dtype=pl.Int32),
            "name": ["loss"] * n,
            "value": [float(x) for x in losses],
        }
    )


def _train_phase(
    model: torch.nn.Module,
    examples: Sequence[Example],
    pad_id: int,
    config: Config,
    epochs: int,
    label: str,
    *stream: int | str,
) -> list[float]:
    """``train_sft`` with the config's settings and a progress bar; minibatch order seeded by
    ``(run.seed, "sft", *stream)``."""
    sft = config.sft
    update, close = terminal_progress(
        label, -(-len(examples) // sft.batch_size) * epochs, log_every_s=sft.log_every_s
    )
    try:
        return train_sft(
            model,
            examples,
            pad_id,
            lr=sft_lr(config),
            epochs=epochs,
            batch_size=sft.batch_size,
            max_tokens=sft.max_tokens_per_batch,
            rng=derive_rng(config.run.seed, "sft", *stream),
            lr_schedule=sft.lr_schedule,
            warmup_steps=sft.warmup_steps,
            bf16_on_cpu=sft.bf16_on_cpu,
            on_step=lambda step, total, loss: update(step, f"loss {loss:.3f}"),
        )
    finally:
        close()


def run_sft(run: Run, config: Config, base_model: Path) -> Path:
    """Write the warm start of ``run`` (demos, losses, checkpoint) from ``base_model``; return the
    checkpoint. Finished parts are kept: existing demos are reused, a complete checkpoint returned.
    With ``sft.dagger_rounds`` = R > 0, R DAgger rounds follow the cloning of the demos
    (``stages.warmstart.dagger``); each writes ``<run>/sft/dagger/round_r/`` (the clone that played, its relabelled
    turns)."""
    from stages.policy.models import prompt_format
    from stages.update.checkpoint import load_model, load_tokenizer, save_checkpoint

    target = run.sft_model_dir
    if checkpoint_complete(target):
        return target
    sft = config.sft
    start = time.perf_counter()
    env = make_demo_environment(config)
    demos_path = run.demos_path
    if demos_path.is_file():
        demos = read_table(demos_path, "steps")
    else:
        demos = split_demos(
            env,
            config,
            sft.split,
            sft.episodes,
            sft.noise,
            sft.invalid_noise,
            sft.keep_noise,
            sft.tasks,
            sft.think,
        )
        write_table(demos, "steps", demos_path)
    torch.set_num_threads(max(1, config.run.torch_threads))
    from stages.policy.models import resolve_device

    # trained on run.device (a GPU when there is one); the DAgger rounds play through an engine of
    # their own on the same device
    model = load_model(base_model, config.model.trust_remote_code).to(resolve_device(config.run.device))
    tokenizer = load_tokenizer(base_model, config.model.trust_remote_code)
    adapters = with_sft_adapters(model, sft.lora)
    if adapters is not None:
        model = adapters.get_base_model()  # the Hugging Face model, its linear layers now adapted
    if sft.gradient_checkpointing:
        from stages.update.checkpoint import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    chat = prompt_format(model, tokenizer, config.model.prompt_format) == "chat"
    # choose mode scores admissible actions after the action tag: its warm start clones that choice
    choose_style = env.prompt_style if config.rollout.mode == "choose" else None
    examples, cut = sft_examples(demos, tokenizer, chat, config.rollout.max_prompt_tokens, choose_style)
    # padding positions are masked out, so any id works; a tokenizer without a pad token (SmolLM2's,
    # from transformers 5.2x on) pads with its EOS id
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    phases = 1 + sft.dagger_rounds  # the bar's label says where the warm start is: its eta is per phase
    losses = _train_phase(model, examples, pad_id, config, sft.epochs, f"sft phase 1/{phases}: demos")
    update_tables = [sft_update_table(losses, -(-len(examples) // sft.batch_size))]
    summary: dict[str, float] = {}
    for round_index in range(1, sft.dagger_rounds + 1):
        relabelled, round_summary = _dagger_play(
            run, config, env, plain_model(model, adapters), tokenizer, round_index
        )
        examples = (
            examples
            + sft_examples(relabelled, tokenizer, chat, config.rollout.max_prompt_tokens, choose_style)[0]
        )
        round_losses = _train_phase(
            model,
            examples,
            pad_id,
            config,
            sft.dagger_epochs,
            f"sft phase {round_index + 1}/{phases}: dagger round {round_index}",
            "dagger",
            round_index,
        )
        first_epoch = sft.epochs + (round_index - 1) * sft.dagger_epochs
        update_tables.append(sft_update_table(round_losses, -(-len(examples) // sft.batch_size), first_epoch))
        losses += round_losses
        summary.update(round_summary)
    summary = {
        **{f"demo_{k}": v for k, v in demo_summary(demos, env.success_outcome).items()},
        **summary,
        "rows": float(len(examples)),  # demos plus every DAgger round's relabelled turns
        "prompt_truncated": float(cut),
        "response_tokens": float(sum(len(e.response_ids) for e in examples)),
        "optimizer_steps": float(len(losses)),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds_sft": time.perf_counter() - start,
    }
    write_table(pl.concat(update_tables), "update", run.sft_dir / "update.parquet")
    write_table(metrics_frame(SFT_ITER, "sft", summary), "metrics", run.sft_dir / "metrics_sft.parquet")
    marker = {"stage": "sft", "base_model": str(base_model), "demos": str(demos_path), "rows": len(examples)}
    if adapters is not None:
        marker["lora"] = {"r": sft.lora.r, "alpha": sft.lora.alpha, "layers": sft.lora.layers, "merged": True}
    return save_checkpoint(target, plain_model(model, adapters, in_place=True), tokenizer, marker)


def with_sft_adapters(model: torch.nn.Module, cfg) -> Any:  # type: ignore[no-untyped-def]
    """The peft model with fresh LoRA adapters of ``sft.lora`` on ``model`` (None when ``sft.lora.r`` is
    0: every weight trains). The adapters start at B = 0, so training starts at the base model."""
    if cfg.r < 1:
        return None
    from peft import get_peft_model

    from stages.policy.adapters import quiet_peft
    from stages.update.lora import peft_config

    with quiet_peft():
        return get_peft_model(model, peft_config(cfg, model))


def plain_model(model: torch.nn.Module, adapters: Any, in_place: bool = False) -> torch.nn.Module:
    """``model`` as a plain Hugging Face model: itself without adapters; with them, W + (alpha / r) B A
    merged into every adapted layer (a copy unless ``in_place``: training goes on after a DAgger
    round's copy). The warm start's checkpoint is always a plain model, so the run's initial policy,
    its KL reference and the base of the update's own LoRA adapters are the same kind of directory
    whether or not the warm start used LoRA."""
    if adapters is None:
        return model
    import copy

    return (adapters if in_place else copy.deepcopy(adapters)).merge_and_unload()


def _dagger_play(
    run: Run, config: Config, env, model: torch.nn.Module, tokenizer, round_index: int
) -> tuple[pl.DataFrame, dict[str, float]]:
    """The play half of DAgger round ``round_index``: the clone so far plays ``sft.dagger_episodes``
    episodes of the demos' task set and the expert relabels them. Returns the relabelled turns and the
    round's metrics (success and invalid rate of the clone's own play)."""
    from stages.update.checkpoint import save_checkpoint

    sft = config.sft
    round_dir = run.sft_dir / "dagger" / f"round_{round_index}"
    clone = save_checkpoint(
        round_dir / "model", model, tokenizer, {"stage": "sft", "dagger_round": round_index}
    )
    played, relabelled = dagger_round(
        live_engine(config, clone, f"dagger-r{round_index}"),
        env,
        split_tasks(env, config, sft.split, sft.tasks),
        sft.dagger_episodes,
        dagger_settings(config),
        round_index=round_index,
        seed=config.run.seed,
        think=sft.think,
        keep_valid=sft.dagger_keep,
    )
    write_table(relabelled, "steps", round_dir / "steps.parquet")
    return relabelled, {
        f"dagger{round_index}_invalid_rate": float(1.0 - played["valid"].mean()),
        f"dagger{round_index}_success_rate": demo_summary(played, env.success_outcome)["success_rate"],
        f"dagger{round_index}_rows": float(relabelled.height),
    }
