"""``run_update(run, iteration, config)``: the policy update stage (docs/design.md §7).

Reads ``iter_NNNN/steps.parquet`` and ``advantages.parquet``; trains the checkpoint of iteration
NNNN - 1 (the initial model in iteration 0; a missing one is an error) with GRPO-C (or token-level GRPO) plus a k3 KL penalty against
the frozen initial model; writes ``metrics_update.parquet`` (table ``metrics``), ``update.parquet``
(table ``update``: per optimizer step and an iteration summary with epoch = minibatch = -1) and then
commits ``checkpoints/iter_NNNN/``. The stage is complete when ``update.parquet`` and the checkpoint
both exist.

Reference log-probs (only when ``update.beta != 0``) are cached in ``iter_NNNN/reflogprobs.parquet``
(a resumed update reuses them). In iteration 0 the policy being trained is the reference, so its old
log-probs are stored as the reference log-probs instead of a second pass over the rows.
With ``update.shared_trunk`` (LoRA on the last K layers, single process), the reference and the policy
share one computation per row of the frozen layers below the adapters (``stages.update.shared_trunk``).
Old (behaviour) log-probs: token rows use the stored ``response_logprobs`` when the rollout engine
is the training engine (``rollout.engine = "hf"``) and the rows were produced by the policy being
trained, and are recomputed otherwise; choose rows recompute ``pi_old`` over their choices with the
pre-update policy (``update.old_logprobs`` = ``auto`` | ``recompute`` | ``stored`` overrides:
``stored`` takes every row's from the rollout, a choose row's ``pi_old(a|s) = log_softmax_j(m_j / T)``
from the ``choice_scores`` its rollout recorded).

Under ``torchrun --nproc_per_node K`` the rows of each minibatch are split across K ranks; rank 0
writes the tables and the one checkpoint.

The runner is a recipe of named steps over one ``UpdateJob``, built once by ``prepare_update_job`` at
the top of the update: the run, iteration, config and distributed context, the steps table (and its
path), the update rows, the policy being trained (``policy_path``), the frozen reference
(``reference_path``, verified against the run's manifest once, here), the tokenizer and the effective
temperature; ``job.is_reference`` says whether the trained policy is the reference (iteration 0). Each
step takes the job plus only what is its own: the model, the optimizer, the old and reference
log-probs, the training result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from schemas import read_table, write_table
from schemas.config import Config
from schemas.errors import GraftError
from schemas.initial_model import acting_policy, verified_initial_policy
from schemas.metrics import metrics_frame
from schemas.rundir import Run
from stages.observe.progress import terminal_progress
from stages.policy.adapters import is_adapter_dir, merged_model
from stages.policy.sampling import choice_log_probs, derive_rng
from stages.update.batching import (
    KEYS,
    UpdateRows,
    build_update_rows,
    drop_flat_groups,
    join_steps_advantages,
)
from stages.update.checkpoint import (
    enable_gradient_checkpointing,
    gather_model_state,
    gather_optimizer_state,
    load_model,
    load_tokenizer,
    restore_optimizer_state,
    save_checkpoint,
    saved_trainer_state,
)
from stages.update.distributed import DistContext, init_distributed, unwrap, wrap_model
from stages.update.lora import adapter_dropout, lora_policy, trainable_parameters
from stages.update.policy_kl import exact_kl, kl_summary, probe_indices, row_distributions
from stages.update.shared_trunk import TrunkCache
from stages.update.shared_trunk import join as join_trunk
from stages.update.shared_trunk import leave as leave_trunk
from stages.update.trainer import RowLogProbs, TrainResult, score_all_rows, train_policy

REFLOGPROBS_FILE = "reflogprobs"


def update_rng(seed: int, iteration: int, purpose: str = "update") -> np.random.Generator:
    """The generator of an iteration's update (same draws on every rank and on resume)."""
    return derive_rng(seed, iteration, purpose)


def effective_temperature(config: Config) -> float:
    """The rollout temperature the ratios use; greedy rollouts (T <= 0) fall back to T = 1."""
    t = config.rollout.temperature
    return t if t > 0 else 1.0


# ---------------------------------------------------------------------------------------------
# the job


@dataclass(frozen=True, eq=False)
class UpdateJob:
    """What every step of one iteration's update reads, built once by ``prepare_update_job``.

    ``steps``: the iteration's steps table (read from ``steps_path``); ``rows``: its rows joined with
    their advantages, tokenized; ``policy_path`` and ``version``: the policy being trained and its
    ``policy_version``, as ``acting_policy`` gives them; ``reference_path``: the frozen reference
    (``verified_initial_policy``); ``temperature``: the temperature the
    ratios use (``effective_temperature``). Not compared (``eq=False``): it holds tables and a model's
    tokenizer."""

    run: Run
    iteration: int
    config: Config
    ctx: DistContext
    steps: pl.DataFrame
    steps_path: Path
    rows: UpdateRows
    policy_path: Path
    version: str
    reference_path: Path
    tokenizer: Any
    temperature: float
    trunk: TrunkCache | None = None  # the rows' shared trunk outputs (update.shared_trunk), else None

    @property
    def is_reference(self) -> bool:
        """The policy being trained is the frozen reference (iteration 0): its old log-probs serve as
        the reference log-probs."""
        return self.policy_path == self.reference_path


def prepare_update_job(run: Run, iteration: int, config: Config, ctx: DistContext) -> UpdateJob:
    """The iteration's ``UpdateJob``: its training rows (none: an error), the policy to train and its
    tokenizer, the rows tokenized, the effective temperature, and the frozen reference (verified once,
    here; every step reads ``job.reference_path``)."""
    steps_path = run.table_path(iteration, "steps")
    steps, joined = read_training_rows(run, iteration)
    if config.update.skip_flat_groups:
        joined = drop_flat_groups(joined)
    policy_path, version = acting_policy(run, iteration, config, "update")
    tokenizer = load_tokenizer(policy_path, config.model.trust_remote_code)
    rows = build_update_rows(joined, token_encoder(tokenizer), source=str(steps_path))
    return UpdateJob(
        run=run,
        iteration=iteration,
        config=config,
        ctx=ctx,
        steps=steps,
        steps_path=steps_path,
        rows=rows,
        policy_path=policy_path,
        version=version,
        reference_path=verified_initial_policy(run, config),
        tokenizer=tokenizer,
        temperature=effective_temperature(config),
        trunk=shared_trunk_cache(config, ctx),
    )


def shared_trunk_cache(config: Config, ctx: DistContext) -> TrunkCache | None:
    """An empty trunk cache when ``update.shared_trunk`` applies: LoRA on the last K layers, one
    process (a rank's rows change from pass to pass under torchrun)."""
    cfg = config.update
    if not cfg.shared_trunk or cfg.lora.r == 0 or cfg.lora.layers == 0 or ctx.distributed:
        return None
    return TrunkCache(cfg.lora.layers)


# ---------------------------------------------------------------------------------------------
# reference log-probs (cached)


def reference_table(rows: UpdateRows, logprobs: list[np.ndarray]) -> pl.DataFrame:
    return rows.keys.with_columns(
        pl.Series("ref_logprobs", [lp.tolist() for lp in logprobs], dtype=pl.List(pl.Float32))
    )


def read_cached_reference(path: Path, rows: UpdateRows) -> list[np.ndarray] | None:
    """Stored reference log-probs when they belong to exactly these rows, else None."""
    if not path.is_file():
        return None
    try:
        table = read_table(path, REFLOGPROBS_FILE)
    except GraftError:  # a damaged cache is recomputed, like a missing one
        return None
    if table.height != rows.n or not table.select(KEYS).equals(rows.keys):
        return None
    out = [np.asarray(v, dtype=np.float32) for v in table["ref_logprobs"].to_list()]
    if any(len(a) != len(r) for a, r in zip(out, rows.response_ids, strict=True)):
        return None
    return out


def compute_reference(
    ref_path: Path,
    rows: UpdateRows,
    config: Config,
    ctx: DistContext,
    temperature: float,
    trunk: TrunkCache | None = None,
) -> list[np.ndarray]:
    """Token log-probs of every response under the frozen reference model (its trunk outputs left in
    ``trunk`` for the policy, when given and shareable).

    A choose row's reference is its chosen action's tokens at T = 1. Alone, the reference scores them
    as a plain ``prompt ++ action`` sequence (the fewest positions); on a shared trunk it scores the
    row packed as the policy passes will (``prompt ++ every choice``), so that they read the trunk it
    computed instead of computing a second one for another sequence.
    """
    model = load_model(ref_path, config.model.trust_remote_code).to(ctx.device).eval()
    model.requires_grad_(False)
    shared = trunk is not None and join_trunk(model, trunk)
    if ctx.distributed and config.update.parallel == "fsdp":
        model = wrap_model(model, ctx, "fsdp")
    scores = score_all_rows(
        model,
        rows,
        temperature,
        config.update.max_tokens_per_batch,
        ctx,
        config.update.bf16,
        as_tokens=not shared,
        bf16_on_cpu=config.update.bf16_on_cpu,
    )
    leave_trunk(model)
    del model
    return scores.tokens


def reference_cache_path(job: UpdateJob) -> Path:
    """``iter_NNNN/reflogprobs.parquet``: the iteration's cached reference log-probs."""
    return job.run.table_path(job.iteration, REFLOGPROBS_FILE)


def reference_logprobs(job: UpdateJob, policy_scores: RowLogProbs | None = None) -> list[np.ndarray]:
    """Cached reference log-probs of the iteration, computing and storing them on first use.

    ``policy_scores``: the old log-probs of the policy being trained when that policy *is* the
    reference (iteration 0): they are then the reference log-probs (both are log-probs of the same
    tokens under the same weights -- token rows at the rollout temperature, choose rows the chosen
    action's tokens at T = 1), so the reference pass is skipped.
    """
    rows, ctx = job.rows, job.ctx
    path = reference_cache_path(job)
    cached = read_cached_reference(path, rows) if ctx.is_main else None
    cached = ctx.broadcast_object(cached)
    if cached is not None:
        return cached
    if policy_scores is not None:
        ref = list(policy_scores.tokens)
    else:
        ref = compute_reference(job.reference_path, rows, job.config, ctx, job.temperature, job.trunk)
    if ctx.is_main:
        write_table(reference_table(rows, ref), REFLOGPROBS_FILE, path)
    ctx.barrier()
    return ref


# ---------------------------------------------------------------------------------------------
# old log-probs


def policy_version(job: UpdateJob) -> str:
    """The ``policy_version`` the rollout stage writes for rows acted by the policy being trained: the
    one ``acting_policy`` gave (the checkpoint directory's name, or ``INITIAL_VERSION``)."""
    return job.version


def stored_logprobs_usable(rows: UpdateRows, config: Config, version: str, steps: pl.DataFrame) -> bool:
    """Token rows may use the stored behaviour log-probs: same engine, same weights, all present.

    Rows without a ``policy_version`` (external data) are trusted to come from the trained policy.
    """
    token_rows = np.flatnonzero(~rows.is_choice)
    if any(rows.behaviour_logprobs[i] is None for i in token_rows):
        return False
    if config.rollout.engine != "hf":
        return False
    versions = steps["policy_version"].gather(token_rows).drop_nulls().unique().to_list()
    return all(v == version for v in versions)


def stored_choice_logprob(rows: UpdateRows, i: int, temperature: float) -> float:
    """log pi_old(a|s) of choose row ``i`` from its rollout's ``choice_scores``: the rollout's own
    ``log_softmax_j(m_j / T)`` at the chosen index (docs/design.md §6)."""
    scores = rows.choice_scores[i] if rows.choice_scores is not None else None
    if scores is None:
        raise ValueError(f"{rows.describe(i)} has no choice_scores")
    return float(choice_log_probs(scores, temperature)[rows.chosen[i]])


def old_logprobs(
    job: UpdateJob, model: torch.nn.Module, stored: np.ndarray, skip: np.ndarray | None = None
) -> RowLogProbs:
    """Log-probs of the pre-update policy: taken from the rollout for the rows ``stored`` marks (n,)
    bool, recomputed for the others; ``skip`` rows are left for the first optimizer step's forward pass
    to fill (``forward_filled_rows``)."""
    rows, config = job.rows, job.config
    recompute = np.flatnonzero(~stored)
    if skip is not None:
        recompute = np.setdiff1d(recompute, skip)
    scored = (
        score_all_rows(
            model,
            rows,
            job.temperature,
            config.update.max_tokens_per_batch,
            job.ctx,
            config.update.bf16,
            only=recompute,
            bf16_on_cpu=config.update.bf16_on_cpu,
        )
        if recompute.size
        else RowLogProbs([np.zeros(0, np.float32)] * rows.n, np.full(rows.n, np.nan))
    )
    for i in np.flatnonzero(stored):
        scored.tokens[i] = rows.behaviour_logprobs[i]  # type: ignore[assignment]
        if rows.is_choice[i]:
            scored.choice[i] = stored_choice_logprob(rows, int(i), job.temperature)
    return scored


def forward_filled_rows(job: UpdateJob, stored: np.ndarray) -> np.ndarray | None:
    """Rows whose old log-probs the first optimizer step's own forward pass provides
    (``update.old_logprobs = "forward"``, one process): the first minibatch's rows that would otherwise
    be recomputed (those ``stored`` does not mark). None when the option is off."""
    from stages.update.trainer import first_minibatch

    rows, config = job.rows, job.config
    if config.update.old_logprobs != "forward" or job.ctx.distributed:
        return None
    first = first_minibatch(rows.n, config.update, update_rng(config.run.seed, job.iteration))
    return first[~stored[first]]


def engine_logprob_gap(
    rows: UpdateRows,
    old: RowLogProbs,
    stored: np.ndarray,
    probe: np.ndarray,
    probe_before: list[torch.Tensor],
    temperature: float,
) -> dict[str, float]:
    """How far the rollout engine's numbers are from the trainer's own under the same weights. Written
    when another engine acted (``rollout.engine != "hf"``): float32 on both sides gives ~1e-6, a dtype
    or kernel mismatch ~1e-3, weights that did not reach the engine far more.

    ``engine_logprob_gap_max`` / ``_mean``: |stored - recomputed| per response token over the rows whose
    old log-probs were recomputed (``stored`` (n,) False). ``engine_choice_gap_max`` / ``_mean``: over
    the KL probe's rows (``probe``, with their pre-update distributions ``probe_before``) that are
    choose rows with ``choice_scores``, |log_softmax(m / T) - the trainer's log pi(j|s)| per choice --
    the check that covers choose rows whose pi_old was never recomputed.
    """
    out: dict[str, float] = {}
    gaps = [
        np.abs(np.asarray(kept, np.float64) - np.asarray(old.tokens[i], np.float64))
        for i, kept in enumerate(rows.behaviour_logprobs)
        if not stored[i] and kept is not None and len(kept) and len(kept) == len(old.tokens[i])
    ]
    scores = rows.choice_scores or [None] * rows.n
    choice_gaps = [
        np.abs(choice_log_probs(scores[i], temperature) - before.double().numpy())
        for i, before in zip(probe.tolist(), probe_before, strict=True)
        if rows.is_choice[i] and scores[i] is not None
    ]
    for name, found in (("engine_logprob_gap", gaps), ("engine_choice_gap", choice_gaps)):
        if found:
            every = np.concatenate(found)
            out |= {f"{name}_max": float(every.max()), f"{name}_mean": float(every.mean())}
    return out


# ---------------------------------------------------------------------------------------------
# outputs


def update_table(iteration: int, result: TrainResult, summary: dict[str, float]) -> pl.DataFrame:
    records = [
        (iteration, epoch, mb, name, float(value))
        for epoch, mb, metrics in result.steps
        for name, value in metrics.items()
    ]
    records += [(iteration, -1, -1, name, float(value)) for name, value in summary.items()]
    return pl.DataFrame(
        records,
        schema={
            "iter": pl.Int32,
            "epoch": pl.Int32,
            "minibatch": pl.Int32,
            "name": pl.Utf8,
            "value": pl.Float64,
        },
        orient="row",
    )


def summarize(result: TrainResult, n_rows: int, seconds: float, extra: dict[str, float]) -> dict[str, float]:
    """Iteration summary: means over optimizer steps, ratio_max the max, totals for rows/seconds."""
    out: dict[str, float] = {}
    names = [name for name in result.steps[0][2]] if result.steps else []
    for name in names:
        values = [m[name] for _, _, m in result.steps if name in m]
        if name == "ratio_max":
            out[name] = max(values)
        elif name == "lr":
            out[name] = values[-1]
        elif name in ("rows", "seconds", "tokens_per_s"):
            continue
        else:
            out[name] = float(np.mean(values))
    out["tokens_per_s"] = result.train_tokens / max(result.train_seconds, 1e-9)
    out["rows"] = float(n_rows)
    out["seconds"] = seconds
    out["steps"] = float(len(result.steps))
    out.update(extra)
    return out


# ---------------------------------------------------------------------------------------------
# the runner


def run_update(run: Run, iteration: int, config: Config) -> None:
    """Run the update stage of ``iteration`` (see the module docstring)."""
    _run_update(run, iteration, config, init_distributed(config.run.device))


def _run_update(run: Run, iteration: int, config: Config, ctx: DistContext) -> None:
    started = time.perf_counter()
    torch.set_num_threads(max(1, config.run.torch_threads))
    cfg = config.update
    job = prepare_update_job(run, iteration, config, ctx)
    rows = job.rows
    torch.manual_seed(int(update_rng(config.run.seed, iteration, "update-torch").integers(2**31)))

    # the policy trained in iteration 0 is the reference: its old log-probs serve as both
    t_ref = time.perf_counter()
    ref = None
    if cfg.beta != 0.0 and not job.is_reference:
        ref = reference_logprobs(job)
    ref_seconds = time.perf_counter() - t_ref

    model, adapters, lora_base = load_policy_to_train(job)
    trunk_shared = job.trunk is not None and join_trunk(model, job.trunk)
    t_old = time.perf_counter()
    stored = stored_logprobs_rows(job)
    model = wrap_model(model, ctx, cfg.parallel)
    # the optimizer takes the (sharded) parameters before any forward pass
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    from_forward = forward_filled_rows(job, stored)
    old = old_logprobs(job, model, stored, skip=from_forward)
    old_seconds = time.perf_counter() - t_old
    probe = probe_indices(rows.n, cfg.kl_probe_rows, update_rng(config.run.seed, iteration, "kl-probe"))
    probe_before = row_distributions(model, rows, probe, job.temperature)
    reference_after = False
    if cfg.beta != 0.0 and job.is_reference:
        t_ref = time.perf_counter()
        cached = read_cached_reference(reference_cache_path(job), rows) if ctx.is_main else None
        if from_forward is not None and from_forward.size and cached is None:
            # the very list the first step fills: its rows' reference log-probs are their old ones
            ref, reference_after = old.tokens, True
        else:
            ref = reference_logprobs(job, policy_scores=old)
        ref_seconds = time.perf_counter() - t_ref

    global_step = resume_optimizer(job, model, optimizer, adapters)
    result = train_with_progress(job, model, old, ref, optimizer, global_step, from_forward)
    if reference_after:  # the reference cache, now that every row's old log-probs exist
        reference_logprobs(job, policy_scores=old)
    probe_tokens = sum(len(d) for d in probe_before)
    moved = kl_summary(
        exact_kl(row_distributions(model, rows, probe, job.temperature), probe_before), probe_tokens
    )
    engine_gap = (
        engine_logprob_gap(rows, old, stored, probe, probe_before, job.temperature)
        if config.rollout.engine != "hf"
        else {}
    )
    del probe_before
    # a LoRA checkpoint is the adapters alone (peft saves them from the peft model)
    model_state = gather_model_state(unwrap(model), keep=ctx.is_main) if adapters is None else None
    optimizer_state = gather_optimizer_state(unwrap(model), optimizer, keep=ctx.is_main)
    if ctx.is_main:
        summary = summarize(
            result,
            rows.n,
            time.perf_counter() - started,
            {
                "ref_seconds": ref_seconds,
                "old_seconds": old_seconds,
                "old_logprobs_stored": float(stored.any()),
                "old_logprobs_stored_rows": float(stored.sum()),
                # rows whose old log-probs came from the first step's own forward pass
                "old_logprobs_from_forward": float(0 if from_forward is None else from_forward.size),
                "choose_rows": float(rows.is_choice.sum()),
                "world_size": float(ctx.world_size),
                **trunk_metrics(job.trunk, trunk_shared),
                **engine_gap,
                **moved,
            },
        )
        write_update_outputs(
            job,
            summary,
            result,
            (unwrap(model), model_state, optimizer_state),
            (adapters, lora_base),
        )
    leave_trunk(unwrap(model))
    if job.trunk is not None:
        job.trunk.clear()
    ctx.barrier()


def trunk_metrics(trunk: TrunkCache | None, policy_joined: bool) -> dict[str, float]:
    """``trunk_shared`` (the policy read the shared trunk: 1, else 0) and the rows whose trunk was
    computed / reused (only with ``update.shared_trunk``)."""
    if trunk is None:
        return {}
    return {
        "trunk_shared": float(policy_joined),
        "trunk_rows_computed": float(trunk.rows_computed),
        "trunk_rows_reused": float(trunk.rows_reused),
    }


# ---------------------------------------------------------------------------------------------
# the runner's steps


def read_training_rows(run: Run, iteration: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The iteration's steps table, and its rows joined with their advantages (none: an error)."""
    steps_path = run.table_path(iteration, "steps")
    steps = run.read(iteration, "steps")
    advantages = run.read(iteration, "advantages")
    joined = join_steps_advantages(
        steps, advantages, str(steps_path), str(run.table_path(iteration, "advantages"))
    )
    if joined.height == 0:
        raise GraftError(f"{steps_path}: no rows to train on")
    return steps, joined


def token_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:  # type: ignore[no-untyped-def]
    """Texts -> token ids with the policy's tokenizer (no special tokens)."""

    def encode(texts: list[str]) -> list[list[int]]:
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]

    return encode


def load_policy_to_train(job: UpdateJob) -> tuple[torch.nn.Module, Any, Path | None]:
    """(model on the device in eval mode, its LoRA adapters or None, the base they adapt or None): the
    policy with fresh adapters when ``update.lora`` is on, a LoRA checkpoint merged when it is off, else
    the model itself; in ``update.master_dtype``, with gradient checkpointing when asked."""
    config, ctx, policy_path = job.config, job.ctx, job.policy_path
    cfg = config.update
    adapters, lora_base = None, None
    if cfg.lora.r > 0:
        if ctx.distributed and cfg.parallel == "fsdp":
            raise GraftError(
                "update.lora needs update.parallel = 'ddp' under torchrun (FSDP2 + LoRA is not supported)"
            )
        # the peft model owns the adapters (saved alone); the trainer sees the Hugging Face model inside,
        # whose adapted layers now compute W x + (alpha / r) B A x
        adapters, lora_base = lora_policy(policy_path, cfg.lora, config.model.trust_remote_code)
        model = adapters.get_base_model().to(ctx.device).eval()
    elif is_adapter_dir(policy_path):  # LoRA switched off: every weight of the merged policy trains
        model = merged_model(policy_path, config.model.trust_remote_code).to(ctx.device).eval()
        model.requires_grad_(True)  # peft froze the base weights
    else:
        model = load_model(policy_path, config.model.trust_remote_code).to(ctx.device).eval()
    if cfg.master_dtype == "bfloat16":  # weights, gradients and AdamW moments in bf16: half the memory
        model = model.to(torch.bfloat16)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model, adapters, lora_base


def stored_logprobs_rows(job: UpdateJob) -> np.ndarray:
    """(n,) bool: the rows whose old log-probs come from the rollout (``update.old_logprobs``:
    "stored" every row, refusing one without them -- a token row needs ``response_logprobs``, a choose
    row ``choice_scores`` too; "auto"/"forward" the token rows when ``stored_logprobs_usable``;
    "recompute" none)."""
    rows, config = job.rows, job.config
    if config.update.old_logprobs == "stored":
        for i in range(rows.n):
            missing = (
                "response_logprobs"
                if rows.behaviour_logprobs[i] is None
                else "choice_scores"
                if rows.is_choice[i] and (rows.choice_scores is None or rows.choice_scores[i] is None)
                else None
            )
            if missing:
                raise GraftError(
                    f"{job.steps_path}: update.old_logprobs = 'stored' but {rows.describe(i)} has no {missing}"
                )
        return np.ones(rows.n, dtype=bool)
    usable = config.update.old_logprobs in ("auto", "forward") and stored_logprobs_usable(
        rows, config, policy_version(job), job.steps
    )
    return ~rows.is_choice if usable else np.zeros(rows.n, dtype=bool)


def resume_optimizer(
    job: UpdateJob, model: torch.nn.Module, optimizer: torch.optim.Optimizer, adapters: Any
) -> int:
    """Restore the AdamW state the policy's checkpoint saved (the initial policy has none); return the
    optimizer step count to go on from. The config, not the restored state, sets the weight decay."""
    global_step = 0
    policy_path = job.policy_path
    if not job.is_reference:
        # AdamW moments carry over only between updates of the same parameters: LoRA switched on
        # (or off) in the middle of a run starts them afresh; the step count goes on either way
        same_parameters = is_adapter_dir(policy_path) == (adapters is not None)
        saved = (
            restore_optimizer_state(unwrap(model), optimizer, policy_path)
            if same_parameters
            else saved_trainer_state(policy_path)
        )
        if saved is not None:
            global_step = int(saved.get("global_step", 0))
    for group in optimizer.param_groups:  # the config, not the restored state, sets these
        group["weight_decay"] = job.config.update.weight_decay
    return global_step


def train_with_progress(
    job: UpdateJob,
    model: torch.nn.Module,
    old: RowLogProbs,
    ref: list[np.ndarray] | None,
    optimizer: torch.optim.Optimizer,
    global_step: int,
    old_from_forward: np.ndarray | None = None,
) -> TrainResult:
    """``train_policy`` with the config's settings and a progress bar (rank 0, on a terminal)."""
    rows, ctx, cfg = job.rows, job.ctx, job.config.update
    total_steps = math.ceil(rows.n / max(1, cfg.minibatch_size)) * cfg.epochs  # = len(schedule)
    show, close = (
        terminal_progress(f"update iter {job.iteration}", total_steps) if ctx.is_main else (None, None)
    )
    done = 0

    def on_step(epoch: int, minibatch: int, metrics: dict[str, float]) -> None:
        nonlocal done
        done += 1
        if show is not None:
            show(done, f"loss {metrics['loss']:.4g}")

    try:
        with adapter_dropout(model):  # no-op without LoRA dropout
            return train_policy(
                model,
                rows,
                old,
                ref,
                cfg,
                job.temperature,
                update_rng(job.config.run.seed, job.iteration),
                ctx,
                optimizer,
                global_step,
                on_step=on_step,
                old_from_forward=old_from_forward,
            )
    finally:
        if close is not None:
            close()


def write_update_outputs(
    job: UpdateJob,
    summary: dict[str, float],
    result: TrainResult,
    trained: tuple[torch.nn.Module, dict | None, dict | None],
    lora: tuple[Any, Path | None],
) -> None:
    """``metrics_update.parquet``, ``update.parquet``, then the checkpoint (its marker says what it was
    trained from and how; the job's tokenizer is saved with it). ``trained``: (model, gathered model
    state, gathered optimizer state); ``lora``: (the adapters, the base they adapt) or (None, None)."""
    run, iteration, cfg = job.run, job.iteration, job.config.update
    model, model_state, optimizer_state = trained
    adapters, lora_base = lora
    metrics = metrics_frame(iteration, "update", summary)
    write_table(metrics, "metrics", run.iter_dir(iteration) / "metrics_update.parquet")
    write_table(update_table(iteration, result, summary), "update", run.table_path(iteration, "update"))
    marker = {
        "iteration": iteration,
        "trained_from": str(job.policy_path),
        "reference": str(job.reference_path),
        "objective": cfg.objective,
        "global_step": result.global_step,
        "rows": job.rows.n,
        "world_size": job.ctx.world_size,
    }
    if adapters is not None:
        marker["lora"] = {
            "r": cfg.lora.r,
            "alpha": cfg.lora.alpha,
            "target_modules": list(cfg.lora.target_modules),
            "layers": cfg.lora.layers,
            "base": str(lora_base),
        }
    save_checkpoint(
        run.checkpoint_dir(iteration),
        model,
        job.tokenizer,
        marker,
        model_state=model_state,
        optimizer_state=optimizer_state,
        trainer_state={"global_step": result.global_step, "iteration": iteration},
        adapters=adapters,
        adapter_base=lora_base,
    )
