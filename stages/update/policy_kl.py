"""How far one update moved the policy: exact KL(π_new ‖ π_old) on a probe of the update's rows.

The clip fraction cannot show this for GRPO-C: its ratio is the geometric mean over a response's
tokens, so a 15× change of one action token's probability among ~15 near-deterministic tokens moves
it by ~1.2 and is never clipped. The KL is exact, not a sampled estimate:

    token row (generate mode):  KL_row = Σ_k Σ_v π_new(v | x, y_<k) [log π_new − log π_old](v | x, y_<k)
                                (the full next-token distributions at T along the sampled response y)
    choice row (choose mode):   KL_row = Σ_j π_new(j | s) [log π_new(j | s) − log π_old(j | s)]

in nats per response. The old distributions are taken before the first optimizer step (CPU, float32:
rows × tokens × vocabulary values, so the probe is a seeded sample of ``update.kl_probe_rows`` rows).
"""

from __future__ import annotations

import numpy as np
import torch

from stages.update.batching import UpdateRows
from stages.update.logprobs import build_choice_batch, build_response_batch, scores_from_flat, selected_logits

_ROWS_PER_PASS = 8


def probe_indices(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """A sorted seeded sample of ``min(n, size)`` row indices (all rows when n <= size)."""
    if size <= 0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    if n <= size:
        return np.arange(n, dtype=np.int64)
    return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)


@torch.no_grad()
def row_distributions(
    model: torch.nn.Module, rows: UpdateRows, indices: np.ndarray, temperature: float
) -> list[torch.Tensor]:
    """Log-distributions per probed row (CPU float32): token rows (R, V) at each response position,
    log softmax(logits / T); choice rows (C,), log π(j | s) over the row's choices."""
    out: list[torch.Tensor] = []
    t = max(temperature, 1e-6)
    for start in range(0, indices.size, _ROWS_PER_PASS):
        part = indices[start : start + _ROWS_PER_PASS].tolist()
        token_rows = [i for i in part if rows.choices[i] is None]
        choice_rows = [i for i in part if rows.choices[i] is not None]
        found: dict[int, torch.Tensor] = {}
        if token_rows:
            batch, slot = build_response_batch(
                [rows.prompt_ids[i] for i in token_rows], [rows.response_ids[i] for i in token_rows]
            )
            log_p = torch.log_softmax(selected_logits(model, batch) / t, dim=-1).cpu()
            for b, i in enumerate(token_rows):
                found[i] = log_p[slot[b][slot[b] >= 0]]
        if choice_rows:
            choices = [rows.choices[i] for i in choice_rows]
            batch, slot = build_choice_batch([rows.prompt_ids[i] for i in choice_rows], choices)  # type: ignore[misc]
            logits = selected_logits(model, batch)
            target = batch.selected.target.to(logits.device)
            flat = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            scores = scores_from_flat(flat, slot.to(flat.device), temperature)
            for b, i in enumerate(choice_rows):
                found[i] = scores.log_probs[b, : len(rows.choices[i])].cpu()  # type: ignore[arg-type]
        out += [found[i] for i in part]
    return out


def exact_kl(new: list[torch.Tensor], old: list[torch.Tensor]) -> np.ndarray:
    """KL(new ‖ old) per row in nats (summed over a token row's positions), shape (rows,)."""
    kl = np.zeros(len(new))
    for r, (log_new, log_old) in enumerate(zip(new, old, strict=True)):
        p_new = log_new.exp()
        terms = torch.where(p_new > 0, p_new * (log_new - log_old), torch.zeros_like(p_new))
        kl[r] = float(terms.sum())
    return np.maximum(kl, 0.0)  # float32 round-off can leave -1e-9 on unchanged rows


def kl_summary(kl: np.ndarray, tokens: int) -> dict[str, float]:
    """``policy_kl`` (mean nats per response), ``policy_kl_p90``, ``policy_kl_max``,
    ``policy_kl_token`` (per scored position or choice), ``policy_kl_rows`` (probe size)."""
    if kl.size == 0:
        return {}
    return {
        "policy_kl": float(kl.mean()),
        "policy_kl_p90": float(np.quantile(kl, 0.9)),
        "policy_kl_max": float(kl.max()),
        "policy_kl_token": float(kl.sum() / max(tokens, 1)),
        "policy_kl_rows": float(kl.size),
    }
