"""The optimization loop of the update stage: scoring rows, old/reference log-probs, optimizer steps.

One optimizer step per minibatch (``update.minibatch_size`` rows of a seeded permutation, for
``update.epochs`` passes). A minibatch is split across ranks and packed into micro-batches; each
micro-batch adds ``loss_sum * world_size / units`` to the gradient (units = rows of the whole
minibatch for GRPO-C, its response tokens for token-level GRPO; the K cancels the K-way average of
DDP/FSDP), so the step equals the one-process step on the same minibatch. Every rank runs the same
number of forward passes (ranks short of micro-batches run a zero-weight one), which FSDP2's
per-forward all-gathers require. Then: gradient clipping (``grad_clip``), linear warm-up over the
first ``warmup_steps`` steps of the run, AdamW.

The model stays in eval mode (dropout off) while training, so that the first step's ratio is exactly
the old policy's (w = 1) -- the usual choice for RL fine-tuning of LLMs.

Row conventions (docs/design.md §6): token rows score ``log_softmax(logits / T)`` of the response; choose rows
score the choice distribution ``softmax_j(mean token log-prob of c_j / T)`` and, for the KL term,
the chosen choice's token log-probs at T = 1.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from schemas.config import UpdateConfig
from schemas.errors import GraftError
from stages.policy.cpu_precision import resolve_bf16_on_cpu
from stages.update.batching import MicroBatch, UpdateRows, minibatch_schedule, pack_microbatches, shard
from stages.update.distributed import DistContext, accumulate, reshard
from stages.update.logprobs import (
    build_choice_batch,
    build_response_batch,
    gather_slots,
    scores_from_flat,
    selected_log_probs,
)
from stages.update.loss import LossTerms, Objective, ScoredRows, k3_kl, objective


@dataclass
class Scored:
    """Scores of the B rows of one micro-batch (tensors on the model's device).

    logp/mask (B, R): log-probs of the response tokens (choose rows: the chosen choice's tokens).
    entropy (B, R) or None. choice_logp (B,): log pi(a|s) over the choices (choose rows) or None.
    bonus_entropy: the entropy bonus's term with its graph (``entropy_grad``), else None: (B,) the
    entropy of each choose row's choice distribution, or (B, R) token rows' per-token entropy.
    """

    logp: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None
    choice_logp: torch.Tensor | None
    input_tokens: int
    bonus_entropy: torch.Tensor | None = None


def score_microbatch(
    model: torch.nn.Module,
    rows: UpdateRows,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    as_tokens: bool = False,
    entropy_grad: bool = False,
) -> Scored:
    """Forward one micro-batch. ``as_tokens`` scores choose rows as plain prompt + response (T = 1):
    the reference needs only the chosen action's token log-probs. ``entropy_grad`` also returns the
    entropy bonus's term with its graph (``Scored.bonus_entropy``)."""
    idx = mb.rows
    prompts = [rows.prompt_ids[i] for i in idx]
    if not mb.choice or as_tokens:
        batch, slot = build_response_batch(prompts, [rows.response_ids[i] for i in idx])
        token_t = 1.0 if mb.choice else temperature
        flat, ent = selected_log_probs(
            model, batch, token_t, with_entropy or entropy_grad, entropy_grad=entropy_grad
        )
        logp, mask = gather_slots(flat, slot)
        entropy = gather_slots(ent, slot)[0] if ent is not None else None
        bonus = entropy if entropy_grad else None
        if entropy is not None and entropy_grad:
            entropy = entropy.detach()
        return Scored(logp, mask, entropy, None, int(batch.attention_mask.sum()), bonus)
    batch, slot = build_choice_batch(prompts, [rows.choices[i] for i in idx])
    chosen = torch.as_tensor(rows.chosen[idx], dtype=torch.long)
    b_range = torch.arange(len(idx))
    chosen_slot = slot[b_range, chosen]  # (B, K)
    entropy_for = None
    if with_entropy:
        entropy_for = torch.zeros(batch.selected.target.shape[0], dtype=torch.bool)
        entropy_for[chosen_slot[chosen_slot >= 0]] = True
    flat, ent = selected_log_probs(model, batch, 1.0, with_entropy, entropy_for)
    scores = scores_from_flat(flat, slot, temperature)
    logp, mask = gather_slots(flat, chosen_slot)
    entropy = gather_slots(ent, chosen_slot)[0] if ent is not None else None
    choice_logp = scores.log_probs[b_range.to(flat.device), chosen.to(flat.device)]
    n_tokens = sum(len(rows.prompt_ids[i]) + sum(len(c) for c in rows.choices[i]) for i in idx)  # type: ignore[union-attr]
    bonus = choice_entropy(scores.log_probs) if entropy_grad else None
    return Scored(logp, mask, entropy, choice_logp, n_tokens, bonus)


def choice_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """H(pi(.|s)) = -sum_j pi_j log pi_j per row of a (B, C) log-prob matrix (-inf = padding): (B,)."""
    finite = torch.isfinite(log_probs)
    safe = torch.where(finite, log_probs, torch.zeros_like(log_probs))
    return -(safe.exp() * safe * finite).sum(-1)


def pad_rows(arrays: list[np.ndarray], width: int, device: torch.device) -> torch.Tensor:
    """Stack float arrays into (B, width), zero-padded on the right."""
    out = np.zeros((len(arrays), width), dtype=np.float32)
    for b, a in enumerate(arrays):
        out[b, : len(a)] = a
    return torch.from_numpy(out).to(device)


def bf16_autocast(
    device: torch.device, enabled: bool, on_cpu: bool | str = False
) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPU when ``enabled``; on CPU only when ``on_cpu`` too (``update.bf16_on_cpu``,
    ``sft.bf16_on_cpu``: CPUs with AMX or AVX-512 BF16 multiply bf16 matrices several times faster than
    float32; otherwise CPU runs stay float32, deterministic and exact enough). The update's and the
    warm start's forward passes both run under it; log-softmax is still taken in float32.
    ``on_cpu = "native"``: on where the CPU multiplies bf16 natively (stages/policy/cpu_precision.py)."""
    if device.type == "cuda" and enabled:
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and enabled and resolve_bf16_on_cpu(on_cpu):
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class RowLogProbs:
    """Per-row log-probs from a no-grad pass over all rows.

    tokens: per row, log-probs of the response tokens (choose rows: chosen choice's tokens, T = 1).
    choice: (n,) log pi(a|s) over the choices for choose rows (NaN for token rows and reference passes).
    """

    tokens: list[np.ndarray]
    choice: np.ndarray


def _plans(
    rows: UpdateRows, indices: np.ndarray, ctx: DistContext, max_tokens: int, as_tokens: bool
) -> tuple[list[MicroBatch], int]:
    """This rank's micro-batches for ``indices`` and the largest count over all ranks."""
    lengths = (
        np.array([len(p) for p in rows.prompt_ids]) + rows.response_lengths
        if as_tokens
        else rows.sequence_lengths
    )
    plans = [
        pack_microbatches(shard(indices, r, ctx.world_size), lengths, rows.is_choice, max_tokens)
        for r in range(ctx.world_size)
    ]
    return plans[ctx.rank], max(len(p) for p in plans)


def _filler(rows: UpdateRows, as_tokens: bool) -> MicroBatch:
    """A one-row micro-batch that keeps a rank in step with the others (its result is discarded)."""
    return MicroBatch(np.array([0]), bool(rows.is_choice[0]) and not as_tokens)


@torch.no_grad()
def score_all_rows(
    model: torch.nn.Module,
    rows: UpdateRows,
    temperature: float,
    max_tokens: int,
    ctx: DistContext,
    bf16: bool = True,
    as_tokens: bool = False,
    only: np.ndarray | None = None,
    bf16_on_cpu: bool = False,
) -> RowLogProbs:
    """Log-probs of every row (or of ``only`` rows) under ``model``, split across ranks and gathered
    on all of them. ``as_tokens``: the reference pass (token log-probs only, choose rows at T = 1)."""
    indices = np.arange(rows.n) if only is None else np.asarray(only, dtype=np.int64)
    indices, copy_of = distinct_rows(rows, indices, as_tokens)
    mine, n_steps = _plans(rows, indices, ctx, max_tokens, as_tokens)
    local: dict[int, tuple[np.ndarray, float]] = {}
    for k in range(n_steps):
        mb = mine[k] if k < len(mine) else _filler(rows, as_tokens)
        with bf16_autocast(ctx.device, bf16, bf16_on_cpu):
            s = score_microbatch(model, rows, mb, temperature, as_tokens=as_tokens)
        if k >= len(mine):
            continue
        logp = s.logp.float().cpu().numpy()
        lengths = s.mask.sum(-1).cpu().numpy()
        choice = s.choice_logp.float().cpu().numpy() if s.choice_logp is not None else None
        for b, i in enumerate(mb.rows):
            local[int(i)] = (
                logp[b, : lengths[b]].copy(),
                float(choice[b]) if choice is not None else math.nan,
            )
    reshard(model)
    merged: dict[int, tuple[np.ndarray, float]] = {}
    for part in ctx.all_gather_object(local):
        merged.update(part)
    tokens: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * rows.n
    choice_lp = np.full(rows.n, math.nan)
    for i, (lp, c) in merged.items():
        tokens[i] = lp.astype(np.float32)
        choice_lp[i] = c
    for i, first in copy_of.items():
        tokens[i], choice_lp[i] = tokens[first], choice_lp[first]
    return RowLogProbs(tokens, choice_lp)


def distinct_rows(
    rows: UpdateRows, indices: np.ndarray, as_tokens: bool
) -> tuple[np.ndarray, dict[int, int]]:
    """The rows of ``indices`` that a no-grad pass must score, and {row: earlier identical row}.

    Rows with the same prompt and response (and, unless ``as_tokens``, the same choices) have the same
    log-probs under one model; group rollouts repeat them often (every rollout of a task starts from
    the same prompt, and a policy that has learned a path repeats it).
    """
    first: dict[tuple[bytes, ...], int] = {}
    keep: list[int] = []
    copy_of: dict[int, int] = {}
    for i in indices.tolist():
        parts = [rows.prompt_ids[i].tobytes(), rows.response_ids[i].tobytes()]
        choices = rows.choices[i]
        if choices is not None and not as_tokens:
            parts += [c.tobytes() for c in choices]
        key = tuple(parts)
        if key in first:
            copy_of[i] = first[key]
        else:
            first[key] = i
            keep.append(i)
    return np.asarray(keep, dtype=np.int64), copy_of


STEP_METRICS = (
    "loss",
    "policy_loss",
    "kl",
    "clip_fraction",
    "ratio_mean",
    "ratio_max",
    "grad_norm",
    "entropy",
    "tokens_per_s",
    "lr",
    "rows",
    "seconds",
)


@dataclass
class TrainResult:
    """Per optimizer step: (epoch, minibatch, {metric: value}); totals for the iteration summary."""

    steps: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    global_step: int = 0
    train_seconds: float = 0.0
    train_tokens: int = 0


def warmup_lr(base_lr: float, warmup_steps: int, global_step: int) -> float:
    """Linear warm-up over the first ``warmup_steps`` optimizer steps of the run (step 0 -> lr/w)."""
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, (global_step + 1) / warmup_steps)


def _grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def check_finite_step(epoch: int, minibatch: int, loss: float, grad_norm: float) -> None:
    """Refuse an optimizer step whose loss or gradient norm is inf/NaN (it would poison the weights)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise GraftError(
            f"update: non-finite loss ({loss:g}) or gradient norm ({grad_norm:g}) at epoch {epoch}, "
            f"minibatch {minibatch}; no checkpoint written (check update.lr, the advantages and the "
            "log-probs of this iteration)"
        )


def train_policy(
    model: torch.nn.Module,
    rows: UpdateRows,
    old: RowLogProbs,
    ref: list[np.ndarray] | None,
    cfg: UpdateConfig,
    temperature: float,
    rng: np.random.Generator,
    ctx: DistContext,
    optimizer: torch.optim.Optimizer,
    global_step: int = 0,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
    old_from_forward: np.ndarray | None = None,
) -> TrainResult:
    """Run ``cfg.epochs`` epochs of minibatch steps on ``model`` (possibly DDP/FSDP-wrapped).

    old: the pre-update policy's log-probs (tokens for every row, choice log-prob for choose rows);
    ref: the reference's token log-probs per row, or None when ``cfg.beta == 0``.
    old_from_forward: rows of the FIRST minibatch whose old log-probs are not in ``old`` yet: they are
    taken (detached) from the first step's own forward pass and written into ``old`` -- before the
    first optimizer step the model is the old policy, so these are the log-probs a separate no-grad
    pass would give, and the step's ratio is exactly 1 for them (``update.old_logprobs = "forward"``).
    """
    if cfg.beta != 0.0 and ref is None:
        raise ValueError("beta != 0 needs reference log-probs")
    result = TrainResult(global_step=global_step)
    loss_fn = objective(cfg.objective)
    world = ctx.world_size
    response_lengths = rows.response_lengths
    schedule = minibatch_schedule(rows.n, cfg.minibatch_size, cfg.epochs, rng)
    per_epoch = math.ceil(rows.n / cfg.minibatch_size)
    device = ctx.device
    fill = set() if old_from_forward is None else {int(i) for i in old_from_forward}
    if fill - {int(i) for i in schedule[0]}:
        raise ValueError("old_from_forward names rows outside the first minibatch")
    for step_i, minibatch in enumerate(schedule):
        epoch, mb_index = divmod(step_i, per_epoch)
        t0 = time.perf_counter()
        n_rows = len(minibatch)
        denom = loss_fn.units(response_lengths[minibatch])
        mine, n_micro = _plans(rows, minibatch, ctx, cfg.max_tokens_per_batch, as_tokens=False)
        # sums: policy, kl, units, clipped, ratio, entropy, entropy tokens, input tokens, bonus entropy
        stats = torch.zeros(9, dtype=torch.float64, device=device)
        ratio_max = torch.full((1,), -math.inf, dtype=torch.float64, device=device)
        for k in range(n_micro):
            real = k < len(mine)
            mb = mine[k] if real else _filler(rows, False)
            with (
                accumulate(model, sync=k == n_micro - 1),
                bf16_autocast(ctx.device, cfg.bf16, cfg.bf16_on_cpu),
            ):
                s = score_microbatch(
                    model, rows, mb, temperature, with_entropy=real, entropy_grad=cfg.entropy_coef > 0
                )
                if real and step_i == 0 and fill:
                    _old_from_scores(s, mb, old, fill)
                terms = _terms(loss_fn, s, rows, mb, old, ref, cfg, device)
                weight = world / denom if real else 0.0
                (terms.loss_sum * weight).backward()
            if not real:
                continue
            stats += torch.tensor(
                [
                    float(terms.policy_sum.detach()),
                    float(terms.kl_sum.detach()),
                    terms.units,
                    float(terms.clipped.sum()),
                    float(terms.ratio.double().sum()),
                    float((s.entropy * s.mask).sum()) if s.entropy is not None else 0.0,
                    float(s.mask.sum()),
                    s.input_tokens,
                    float(terms.entropy_sum.detach()) if terms.entropy_sum is not None else 0.0,
                ],
                dtype=torch.float64,
                device=device,
            )
            if terms.ratio.numel():
                ratio_max = torch.maximum(ratio_max, terms.ratio.double().max().reshape(1))
        grad_norm = _grad_norm(model, cfg.grad_clip)
        ctx.all_reduce(stats)
        ctx.all_reduce(ratio_max, op="max")
        policy_sum, kl_sum, units, clipped, ratio_sum, ent_sum, ent_n, tokens, bonus_sum = stats.tolist()
        loss = (policy_sum + cfg.beta * kl_sum - cfg.entropy_coef * bonus_sum) / denom
        # every rank sees the same reduced loss and global norm, so all stop together, before a step
        # that would write NaN into the weights
        check_finite_step(epoch, mb_index, loss, grad_norm)
        lr = warmup_lr(cfg.lr, cfg.warmup_steps, result.global_step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        try:
            optimizer.step()
        except RuntimeError as exc:  # torch refuses a step size beyond float32 (an absurd lr)
            if "overflow" not in str(exc):
                raise
            raise GraftError(f"update: optimizer step overflowed float32 (update.lr = {lr:g})") from None
        optimizer.zero_grad(set_to_none=True)
        result.global_step += 1
        seconds = time.perf_counter() - t0
        metrics = {
            "loss": loss,
            "policy_loss": policy_sum / denom,
            "clip_fraction": clipped / max(units, 1.0),
            "ratio_mean": ratio_sum / max(units, 1.0),
            "ratio_max": float(ratio_max.item()),
            "grad_norm": grad_norm,
            "entropy": ent_sum / max(ent_n, 1.0),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "lr": lr,
            "rows": float(n_rows),
            "seconds": seconds,
        }
        if ref is not None:
            metrics["kl"] = kl_sum / denom
        result.steps.append((epoch, mb_index, metrics))
        result.train_seconds += seconds
        result.train_tokens += int(tokens)
        if on_step is not None:
            on_step(epoch, mb_index, metrics)
    # a finite loss and gradient can still take an inf/NaN step (an absurd lr): check the weights once
    bad = torch.zeros(1, dtype=torch.float64, device=device)
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param  # an FSDP2 shard
        if not bool(torch.isfinite(local.detach()).all()):
            bad += 1
            break
    if float(ctx.all_reduce(bad, op="max").item()) > 0:
        raise GraftError(
            f"update: the weights became non-finite after {result.global_step} optimizer step(s) "
            f"(update.lr = {cfg.lr:g}); no checkpoint written"
        )
    return result


def first_minibatch(n_rows: int, cfg: UpdateConfig, rng: np.random.Generator) -> np.ndarray:
    """The rows of the first optimizer step ``train_policy`` will take with ``rng`` (a copy is drawn
    from, so the caller's generator is unchanged)."""
    import copy

    return minibatch_schedule(n_rows, cfg.minibatch_size, cfg.epochs, copy.deepcopy(rng))[0]


def _old_from_scores(s: Scored, mb: MicroBatch, old: RowLogProbs, fill: set[int]) -> None:
    """Write the detached log-probs of ``s`` into ``old`` for the micro-batch's rows in ``fill``."""
    logp = s.logp.detach().float().cpu().numpy()
    lengths = s.mask.sum(-1).cpu().numpy()
    choice = s.choice_logp.detach().float().cpu().numpy() if s.choice_logp is not None else None
    for b, i in enumerate(mb.rows.tolist()):
        if i in fill:
            old.tokens[i] = logp[b, : lengths[b]].copy()
            if choice is not None:
                old.choice[i] = float(choice[b])


def _terms(
    loss_fn: Objective,
    s: Scored,
    rows: UpdateRows,
    mb: MicroBatch,
    old: RowLogProbs,
    ref: list[np.ndarray] | None,
    cfg: UpdateConfig,
    device: torch.device,
) -> LossTerms:
    """The registered objective's sums for one scored micro-batch."""
    idx = mb.rows
    width = s.logp.shape[1]
    logp = s.logp.float()
    kl_tok = None
    if ref is not None and cfg.beta != 0.0:
        kl_tok = k3_kl(logp, pad_rows([ref[i] for i in idx], width, device))
    choice_log_ratio = None
    if s.choice_logp is not None:
        old_choice = torch.as_tensor(old.choice[idx], dtype=torch.float32, device=device)
        choice_log_ratio = s.choice_logp.float() - old_choice
    scored = ScoredRows(
        logp=logp,
        old_logp=pad_rows([old.tokens[i] for i in idx], width, device),
        mask=s.mask,
        adv=torch.as_tensor(rows.advantage[idx], dtype=torch.float32, device=device),
        kl_tok=kl_tok,
        choice_log_ratio=choice_log_ratio,
        entropy=s.bonus_entropy.float() if s.bonus_entropy is not None else None,
    )
    return loss_fn.terms(scored, cfg.clip_low, cfg.clip_high, cfg.beta, cfg.entropy_coef)
