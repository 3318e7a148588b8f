"""Log-probabilities of responses and of admissible choices under a causal LM (differentiable).

Two layouts, both right-padded batches:

* token rows (``generate`` mode): one sequence ``prompt ++ response`` per row, 2-D attention mask.
  Response token k sits at position ``P + k`` and is predicted by the logits at ``P + k - 1``.
* choice rows (``choose`` mode, docs/design.md §6): one sequence ``prompt ++ c_1 ++ ... ++ c_C`` per row, with a
  4-D attention mask in which every choice sees the whole prompt and its own earlier tokens only, and
  position ids that restart at ``P`` for each choice. Each choice is then scored exactly as if it were
  the sole continuation of the prompt, but the prompt is encoded once per row (the prompt dominates
  the length: ~300 prompt tokens vs ~3 tokens per action).

Choice policy (shared with ``stages/policy/choice.py``)::

    m_j      = (1/|c_j|) sum_k log p(c_j[k] | prompt, c_j[<k])     (mean per-token log-prob, T = 1)
    pi(j|s)  = softmax_j(m_j / T)                                    (T = rollout temperature)

Token rows score ``log softmax(logits / T)`` (the distribution the rollout sampled from).
Log-softmax is always taken in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stages.update.last_layer import selected_final_hidden, supports_last_layer_pruning
from stages.update.shared_trunk import final_hidden

PAD_ID = 0  # any valid id: padded positions are masked out of attention and never selected


@dataclass(frozen=True)
class SelectedTokens:
    """Which logits to read: flat index arrays of length N (one per scored token)."""

    batch: torch.Tensor  # (N,) row in the padded batch
    position: torch.Tensor  # (N,) position whose logits predict the token
    target: torch.Tensor  # (N,) the token id


@dataclass(frozen=True)
class TokenBatch:
    """A padded model input plus the tokens to score.

    input_ids (B, L); attention_mask (B, L) for token rows or (B, 1, L, L) bool for choice rows;
    position_ids (B, L) or None (default 0..L-1).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None
    selected: SelectedTokens


def _as_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    return [int(x) for x in ids]


def build_response_batch(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
) -> tuple[TokenBatch, torch.Tensor]:
    """Pad ``prompt ++ response`` rows; returns the batch and ``slot`` (B, R) = index into the flat
    selection of response token k of row b (-1 where row b has fewer than k+1 tokens)."""
    seqs = [_as_list(p) + _as_list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    b_n, l_max = len(seqs), max(len(s) for s in seqs)
    r_max = max(len(r) for r in response_ids)
    input_ids = torch.full((b_n, l_max), PAD_ID, dtype=torch.long)
    attention = torch.zeros((b_n, l_max), dtype=torch.long)
    batch_idx, pos_idx, targets = [], [], []
    slot = torch.full((b_n, r_max), -1, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        seq = seqs[b]
        input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[b, : len(seq)] = 1
        n_p, n_r = len(p), len(r)
        if n_p == 0:
            raise ValueError("a row has an empty prompt: the first response token has no context")
        slot[b, :n_r] = torch.arange(len(targets), len(targets) + n_r)
        batch_idx += [b] * n_r
        pos_idx += list(range(n_p - 1, n_p - 1 + n_r))
        targets += _as_list(r)
    selected = SelectedTokens(torch.tensor(batch_idx), torch.tensor(pos_idx), torch.tensor(targets))
    return TokenBatch(input_ids, attention, None, selected), slot


def build_choice_batch(
    prompt_ids: Sequence[Sequence[int]], choices: Sequence[Sequence[Sequence[int]]]
) -> tuple[TokenBatch, torch.Tensor]:
    """Pack each row as ``prompt ++ c_1 ++ ... ++ c_C`` with a per-choice attention pattern.

    Returns the batch and ``slot`` (B, C, K) = index into the flat selection of token k of choice j
    of row b (-1 for padding: rows with fewer choices, choices with fewer tokens).
    """
    b_n = len(prompt_ids)
    lengths = [len(p) + sum(len(c) for c in cs) for p, cs in zip(prompt_ids, choices, strict=True)]
    l_max = max(lengths)
    c_max = max(len(cs) for cs in choices)
    k_max = max(len(c) for cs in choices for c in cs)
    input_ids = torch.full((b_n, l_max), PAD_ID, dtype=torch.long)
    position_ids = torch.zeros((b_n, l_max), dtype=torch.long)
    # allowed[b, q, k]: query q may attend key k. Padded queries attend to themselves only, so that
    # no softmax row is empty (an all-masked row gives NaN in SDPA).
    allowed = torch.eye(l_max, dtype=torch.bool).repeat(b_n, 1, 1)
    slot = torch.full((b_n, c_max, k_max), -1, dtype=torch.long)
    batch_idx: list[int] = []
    pos_idx: list[int] = []
    targets: list[int] = []
    for b, (p, cs) in enumerate(zip(prompt_ids, choices, strict=True)):
        n_p = len(p)
        if n_p == 0:
            raise ValueError("a row has an empty prompt: the first choice token has no context")
        if not cs:
            raise ValueError("a choose-mode row has no choices")
        input_ids[b, :n_p] = torch.tensor(_as_list(p), dtype=torch.long)
        position_ids[b, :n_p] = torch.arange(n_p)
        allowed[b, :n_p, :n_p] = torch.ones(n_p, n_p, dtype=torch.bool).tril()
        start = n_p
        for j, c in enumerate(cs):
            n_c = len(c)
            if n_c == 0:
                raise ValueError("a choice encodes to zero tokens")
            end = start + n_c
            input_ids[b, start:end] = torch.tensor(_as_list(c), dtype=torch.long)
            position_ids[b, start:end] = torch.arange(n_p, n_p + n_c)
            allowed[b, start:end, :n_p] = True
            allowed[b, start:end, start:end] = torch.ones(n_c, n_c, dtype=torch.bool).tril()
            slot[b, j, :n_c] = torch.arange(len(targets), len(targets) + n_c)
            batch_idx += [b] * n_c
            # token 0 is predicted by the last prompt position, token k by the choice's token k-1
            pos_idx += [n_p - 1] + list(range(start, end - 1))
            targets += _as_list(c)
            start = end
        position_ids[b, start:] = torch.arange(l_max - start) + start  # padding: any valid positions
    selected = SelectedTokens(torch.tensor(batch_idx), torch.tensor(pos_idx), torch.tensor(targets))
    return TokenBatch(input_ids, allowed.unsqueeze(1), position_ids, selected), slot


def _model_mask(mask: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A 4-D bool mask in the form the model's attention implementation expects."""
    if mask.dim() != 4:
        return mask
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", "sdpa") if config is not None else "sdpa"
    if impl == "eager":  # eager attention adds the mask to the scores
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)
    if impl is not None and impl.startswith("flash"):
        raise ValueError(
            "choose-mode scoring needs a 4-D attention mask; flash attention has none (use sdpa)"
        )
    return mask


class SelectedLogits(torch.nn.Module):
    """A causal LM that returns logits only at selected (row, position) pairs: ``(N, V)``.

    The language-model head (hidden 64 -> a vocabulary of thousands for the tiny model, 150k for
    Qwen2.5) dominates the cost when every position gets logits; choose rows need ~2% of them.
    Models whose causal-LM forward does more than ``lm_head(decoder(x))`` (a final logit
    soft-cap) take the plain full-logits path. The trainer wraps this module (not the bare model)
    in DDP/FSDP2, so the wrapper's forward is the one that synchronizes.
    """

    full_logits = False  # True: always the full-logits path (the benchmark's comparison)
    prune_last_layer = True  # False: run the last decoder layer at every position (the reference path)

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        sel_batch: torch.Tensor,
        sel_position: torch.Tensor,
    ) -> torch.Tensor:
        lm = self.lm
        config = getattr(lm, "config", None)
        direct = (
            not self.full_logits
            and hasattr(lm, "get_decoder")
            and lm.get_output_embeddings() is not None
            and getattr(config, "final_logit_softcapping", None) is None
        )
        if not direct:
            out = lm(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
            return out.logits[sel_batch, sel_position]
        # a model that joined a trunk cache (stages.update.shared_trunk) runs only its top layers
        shared = final_hidden(lm, input_ids, attention_mask, position_ids)
        if shared is not None:
            selected = shared[sel_batch, sel_position]
        elif self.prune_last_layer and supports_last_layer_pruning(lm):
            selected = selected_final_hidden(
                lm, input_ids, attention_mask, position_ids, sel_batch, sel_position
            )
        else:
            hidden = lm.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )[0]
            selected = hidden[sel_batch, sel_position]
        return lm.get_output_embeddings()(selected)


def as_scorer(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` if it already is (a DDP wrapper of) a SelectedLogits, else a SelectedLogits around it."""
    inner = getattr(model, "module", model)
    return model if isinstance(inner, SelectedLogits) else SelectedLogits(model)


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP / SelectedLogits wrappers."""
    inner = getattr(model, "module", model)
    return inner.lm if isinstance(inner, SelectedLogits) else inner


def selected_logits(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Forward ``batch``; float32 logits at its selected positions, shape (N, V)."""
    scorer = as_scorer(model)
    device = next(scorer.parameters()).device
    sel = batch.selected
    return scorer(
        batch.input_ids.to(device),
        _model_mask(batch.attention_mask, language_model(scorer)).to(device),
        None if batch.position_ids is None else batch.position_ids.to(device),
        sel.batch.to(device),
        sel.position.to(device),
    ).float()


def selected_log_probs(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_for: torch.Tensor | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward ``batch`` and return (log p(target) of each selected token (N,), entropy (N,) or None).

    ``log p = log_softmax(logits / temperature)`` in float32. The entropy is the full-vocabulary
    entropy of the same distribution; ``entropy_for`` (N,) bool restricts it to some tokens (others 0).
    It is a metric without a graph unless ``entropy_grad`` (the update's entropy bonus).
    """
    logits = selected_logits(model, batch)
    device = logits.device
    sel = batch.selected
    if temperature != 1.0:
        logits = logits / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, sel.target.to(device).unsqueeze(-1)).squeeze(-1)
    token_lp = target_logit - log_norm
    entropy = None
    if with_entropy:  # a metric (no graph), or the entropy bonus's term (entropy_grad)
        source = logits if entropy_grad else logits.detach()
        source_norm = log_norm if entropy_grad else log_norm.detach()
        rows = source if entropy_for is None else source[entropy_for.to(device)]
        norm = source_norm if entropy_for is None else source_norm[entropy_for.to(device)]
        log_p = rows - norm.unsqueeze(-1)
        ent = -(log_p.exp() * log_p).sum(-1)
        if entropy_for is None:
            entropy = ent
        else:
            zeros = torch.zeros_like(token_lp if entropy_grad else token_lp.detach())
            entropy = zeros.masked_scatter(entropy_for.to(device), ent)
    return token_lp, entropy


def gather_slots(flat: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Arrange flat per-token values into the padded ``slot`` layout; returns (values, mask)."""
    mask = (slot >= 0).to(flat.device)
    values = flat[slot.clamp(min=0).to(flat.device)] * mask
    return values, mask


def response_log_probs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of each response: (logp (B, R), mask (B, R) bool, entropy (B, R) or None)."""
    batch, slot = build_response_batch(prompt_ids, response_ids)
    flat, ent = selected_log_probs(model, batch, temperature, with_entropy)
    logp, mask = gather_slots(flat, slot)
    entropy = gather_slots(ent, slot)[0] if ent is not None else None
    return logp, mask, entropy


@dataclass(frozen=True)
class ChoiceScores:
    """Scores of a batch of choice rows (B rows, up to C choices of up to K tokens).

    log_probs:   (B, C) log pi(j|s) = log_softmax_j(mean_logprob / T) over each row's choices (-inf pad)
    mean_logprob:(B, C) mean per-token log-prob of each choice (0 for padding)
    token_logprobs: (B, C, K) per-token log-probs at T = 1 (0 for padding); token_mask (B, C, K) bool
    entropy:     (B, C, K) token entropies where requested (else None)
    """

    log_probs: torch.Tensor
    mean_logprob: torch.Tensor
    token_logprobs: torch.Tensor
    token_mask: torch.Tensor
    entropy: torch.Tensor | None = None


def scores_from_flat(
    flat: torch.Tensor, slot: torch.Tensor, temperature: float, entropy: torch.Tensor | None = None
) -> ChoiceScores:
    """Turn flat per-token log-probs of a choice batch into the choice distribution."""
    token_lp, token_mask = gather_slots(flat, slot)
    n_tok = token_mask.sum(-1)  # (B, C)
    valid = n_tok > 0
    mean_lp = token_lp.sum(-1) / n_tok.clamp(min=1)
    logits = (mean_lp / temperature).masked_fill(~valid, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    ent = gather_slots(entropy, slot)[0] if entropy is not None else None
    return ChoiceScores(log_probs, mean_lp, token_lp, token_mask, ent)


def choice_log_probs(
    model: torch.nn.Module,
    prompt_ids_batch: Sequence[Sequence[int]],
    choices_batch: Sequence[Sequence[Sequence[int]]],
    temperature: float = 1.0,
) -> ChoiceScores:
    """Differentiable choice distribution of each row: ``pi(j|s) = softmax_j(m_j / T)`` (docs/design.md §6).

    prompt_ids_batch: B token lists; choices_batch: B lists of token lists (each choice's ids as
    ``tokenizer.encode(choice, add_special_tokens=False)``, placed right after the prompt).
    """
    batch, slot = build_choice_batch(prompt_ids_batch, choices_batch)
    flat, _ = selected_log_probs(model, batch, 1.0)
    return scores_from_flat(flat, slot, temperature)
