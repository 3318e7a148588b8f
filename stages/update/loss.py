"""Policy-gradient losses of the update stage (docs/design.md §7; paper Sec. 2, Eq. 3-4).

GRPO-C (``objective = "grpo_c"``, the default), per step row i with response o_i and advantage A_i::

    log w_i = (1/|o_i|) sum_t [log pi_theta(o_it | .) - log pi_old(o_it | .)]      (Eq. 3, geometric mean)
            = log pi_theta(a_i|s_i) - log pi_old(a_i|s_i)        (choose mode: ratio over the choices)
    l_i     = -min(w_i A_i, clip(w_i, 1 - clip_low, 1 + clip_high) A_i)            (Eq. 4)
    kl_i    = (1/|o_i|) sum_t k3(ref_it, logp_it)
    loss    = (1/R) sum_i (l_i + beta kl_i - c H_i)                     (R = rows in the minibatch)

H_i is the optional entropy bonus (``update.entropy_coef`` = c, experimental, 0 = the paper's
objective): the entropy of the choice distribution for choose rows, the mean token entropy of the
response for token rows; the token-level objective adds ``- c H_it`` per token.

GRPO (``objective = "grpo"``, the token-level ablation), per response token (i, t)::

    r_it = exp(logp_it - old_it);   l_it = -min(r_it A_i, clip(r_it, ...) A_i)
    loss = (1/T) sum_{i,t} (l_it + beta k3_it)                   (T = response tokens in the minibatch)

k3 ("low_var_kl", Schulman's estimator of KL(pi_theta || pi_ref) from samples of pi_theta), with
verl's clamps: ``d = clamp(ref - logp, -20, 20); k3 = clamp(exp(d) - d - 1, -10, 10)``.

Clip bounds (``update.clip_low`` / ``update.clip_high``, default 0.2 / 0.2 for both objectives) were
chosen by measuring the clip fraction (share of rows whose gradient the clip cuts) of the sequence
ratio on tiny-model updates (docs/results/speed.md "Update throughput (CPU)", clip table): in ``choose`` mode
w is a ratio of action probabilities and moves like a token ratio -- eps = 0.2 clips 11-14% of rows
per iteration (the usual PPO range), eps <= 3e-3 clips 28-46% and stalled learning; with 64-token
generated responses the geometric mean moves less -- eps = 0.2 clips 3-6% at lr 3e-3 and nothing at
lr 1e-4, while GSPO's 3e-4..3e-3 clip 34-78%. Check ``clip_fraction`` in the update table when the
learning rate or response lengths change.

The functions return *sums* and unit counts instead of means, so that a minibatch split into
micro-batches and across ranks divides by the global count once (the caller's job): the gradient is
then independent of how the minibatch was split.

Objectives live in one registry, ``OBJECTIVES`` (name -> ``Objective``: its terms function together
with the unit its minibatch mean divides by, rows or response tokens), the way the credit stage's
estimators do; ``update.objective`` names one. Add one with ``@register_objective(name, unit)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: keeps exp finite; such a ratio is clipped anyway


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = ref - logp (clamped)."""
    delta = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(delta) - delta - 1.0).clamp(-10.0, 10.0)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 3 in log space: mean over each row's response tokens of (logp - old). Shapes (B, R) -> (B,)."""
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO surrogate as a loss: (-min(r A, clip(r, 1-lo, 1+hi) A), clip active) elementwise.

    "Clip active" = the clipped branch is the larger loss, i.e. the gradient through r is cut
    (A > 0 and r > 1 + hi, or A < 0 and r < 1 - lo).
    """
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    return torch.maximum(unclipped, clipped), clipped > unclipped


@dataclass
class LossTerms:
    """Sums over the units of one (micro-)batch; divide by the global unit count for the mean.

    units: rows (grpo_c) or response tokens (grpo). ratio/clipped: per unit, detached.
    """

    loss_sum: torch.Tensor
    policy_sum: torch.Tensor
    kl_sum: torch.Tensor
    units: int
    ratio: torch.Tensor
    clipped: torch.Tensor
    entropy_sum: torch.Tensor | None = None  # the bonus's entropy sum (None when the bonus is off)


def grpo_c_terms(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    kl_tok: torch.Tensor | None,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    beta: float,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> LossTerms:
    """GRPO-C sums over B rows. log_ratio (B,) = log w_i; adv (B,); kl_tok (B, R) k3 per response token
    (None when beta = 0); mask (B, R) response tokens; entropy (B,) H_i with grad (None: no bonus)."""
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    pg, clip_active = clipped_surrogate(ratio, adv.to(ratio.dtype), clip_low, clip_high)
    policy_sum = pg.sum()
    if kl_tok is not None:
        m = mask.to(kl_tok.dtype)
        kl_sum = ((kl_tok * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    else:
        kl_sum = torch.zeros((), dtype=pg.dtype, device=pg.device)
    loss_sum = policy_sum + beta * kl_sum
    entropy_sum = None
    if entropy is not None:
        entropy_sum = entropy.sum()
        loss_sum = loss_sum - entropy_coef * entropy_sum
    return LossTerms(
        loss_sum, policy_sum, kl_sum, int(ratio.shape[0]), ratio.detach(), clip_active, entropy_sum
    )


def grpo_token_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    kl_tok: torch.Tensor | None,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    beta: float,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> LossTerms:
    """Token-level GRPO sums over the response tokens of B rows (shapes (B, R); adv (B,); entropy
    (B, R) per-token H_it with grad, None: no bonus)."""
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    pg, clip_active = clipped_surrogate(ratio, adv.to(ratio.dtype).unsqueeze(-1), clip_low, clip_high)
    m = mask.to(pg.dtype)
    policy_sum = (pg * m).sum()
    kl_sum = (kl_tok * m).sum() if kl_tok is not None else torch.zeros((), dtype=pg.dtype, device=pg.device)
    keep = mask.bool()
    loss_sum = policy_sum + beta * kl_sum
    entropy_sum = None
    if entropy is not None:
        entropy_sum = (entropy * m).sum()
        loss_sum = loss_sum - entropy_coef * entropy_sum
    return LossTerms(
        loss_sum,
        policy_sum,
        kl_sum,
        int(keep.sum()),
        ratio.detach()[keep],
        clip_active[keep],
        entropy_sum,
    )


@dataclass
class ScoredRows:
    """What an objective reads of B scored rows (tensors on one device).

    logp / old_logp / mask: (B, R) response-token log-probs under the policy being trained and the
    behaviour policy, and the response mask; adv (B,); kl_tok (B, R) k3 to the reference or None
    (beta = 0); choice_log_ratio (B,) log pi(a|s) - log pi_old(a|s) over the choices for choose rows,
    else None; entropy: the bonus's term with its graph or None -- (B,) per row (choose rows) or
    (B, R) per token (token rows).
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    kl_tok: torch.Tensor | None = None
    choice_log_ratio: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


Unit = Literal["rows", "tokens"]
TermsFunction = Callable[[ScoredRows, float, float, float, float], LossTerms]


@dataclass(frozen=True)
class Objective:
    """A registered objective: ``terms(rows, clip_low, clip_high, beta, entropy_coef)`` gives its sums,
    and ``unit`` says what the minibatch mean divides them by (its rows, or its response tokens)."""

    name: str
    unit: Unit
    terms: TermsFunction

    def units(self, response_lengths) -> int:  # type: ignore[no-untyped-def]
        """The minibatch's divisor from its rows' response lengths (a numpy array)."""
        return len(response_lengths) if self.unit == "rows" else int(response_lengths.sum())


OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str, unit: Unit) -> Callable[[TermsFunction], TermsFunction]:
    """Register ``fn`` as objective ``name`` averaged over ``unit``."""

    def wrap(fn: TermsFunction) -> TermsFunction:
        OBJECTIVES[name] = Objective(name, unit, fn)
        return fn

    return wrap


def objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}") from None


@register_objective("grpo_c", "rows")
def grpo_c(
    rows: ScoredRows, clip_low: float, clip_high: float, beta: float, entropy_coef: float
) -> LossTerms:
    """GRPO-C (Eq. 3-4): the sequence ratio (choose rows: the choice ratio), one term per row."""
    if rows.choice_log_ratio is not None:
        log_ratio = rows.choice_log_ratio
    else:
        log_ratio = sequence_log_ratio(rows.logp, rows.old_logp, rows.mask)
    bonus = rows.entropy
    if bonus is not None and bonus.dim() == 2:  # token rows: the response's mean token entropy
        m = rows.mask.to(bonus.dtype)
        bonus = (bonus * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    return grpo_c_terms(
        log_ratio, rows.adv, rows.kl_tok, rows.mask, clip_low, clip_high, beta, bonus, entropy_coef
    )


@register_objective("grpo", "tokens")
def grpo_token(
    rows: ScoredRows, clip_low: float, clip_high: float, beta: float, entropy_coef: float
) -> LossTerms:
    """Token-level GRPO (the ablation): a ratio and a term per response token."""
    bonus = rows.entropy
    if bonus is not None and bonus.dim() == 1:  # a choose row's one entropy spread over its tokens
        m = rows.mask.to(bonus.dtype)
        bonus = bonus.unsqueeze(-1) * m / m.sum(-1, keepdim=True).clamp(min=1.0)
    return grpo_token_terms(
        rows.logp,
        rows.old_logp,
        rows.adv,
        rows.kl_tok,
        rows.mask,
        clip_low,
        clip_high,
        beta,
        bonus,
        entropy_coef,
    )


def policy_loss(
    objective_name: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    beta: float,
) -> tuple[torch.Tensor, LossTerms]:
    """Mean loss of one whole batch of token rows (the single-batch form of the objectives).

    logp/old_logp/ref_logp/mask: (B, R) per response token; adv (B,). Returns (loss, terms).
    """
    kl_tok = k3_kl(logp, ref_logp) if ref_logp is not None and beta != 0.0 else None
    terms = objective(objective_name).terms(
        ScoredRows(logp, old_logp, mask, adv, kl_tok), clip_low, clip_high, beta, 0.0
    )
    return terms.loss_sum / max(terms.units, 1), terms
