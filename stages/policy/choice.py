"""``choose`` mode scoring: log-probs of admissible actions as continuations of a prompt (docs/design.md §6).

Shared convention with the update stage (must hold exactly)::

    prompt_ids          = tokenizer(prompt) ids (the exact model input)
    choice_ids[j]       = tokenizer.encode(choices[j], add_special_tokens=False), appended directly
                          after prompt_ids (no separator token)
    lp_j[i]             = log p_model(choice_ids[j][i] | prompt_ids + choice_ids[j][:i])   (raw model,
                          no temperature)
    m_j                 = mean_i lp_j[i]                         (mean, not sum: docs/design.md §6)
    log π(a_j | s)      = log_softmax_j(m_j / T)                 (T = rollout temperature; T <= 0 greedy)
    response_ids        = choice_ids[chosen],  response_logprobs = lp_chosen

Efficiency: the prompt goes through the model once (``score_choices_batch`` does this for many
prompts at once, left-padded); the choices then run on top of the prompt's KV cache, either packed
into one sequence per prompt with a block-diagonal 4-D mask (default with sdpa/eager attention: the
cache is not copied) or as a right-padded batch on the cache repeated once per choice (any attention
implementation). Positions continue from each prompt's own length. Memory is bounded by
``token_budget`` (cached + fed positions times rows per forward) and ``logit_budget`` (fed positions
times vocabulary per forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from stages.policy.models import forward_with_cache
from stages.policy.sampling import choice_log_probs

TOKEN_BUDGET = 1 << 20  # cached positions x rows held at once while scoring choices
LOGIT_BUDGET = 1 << 26  # choice positions x vocabulary per forward (256 MiB of float32 logits)


def left_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token sequences: (ids [B, P], attention mask [B, P], position ids [B, P])."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq):
            ids[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def _select_cache(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """A new cache holding ``rows`` (batch indices, may repeat) of ``cache``; ``cache`` is unchanged."""
    return DynamicCache(
        ddp_cache_data=[(k.index_select(0, rows), v.index_select(0, rows)) for k, v, *_ in cache]
    )


def _feed_length(choices: Sequence[Sequence[int]]) -> int:
    """Tokens fed for one prompt's choices in the packed layout (all but each choice's last token)."""
    return sum(len(c) - 1 for c in choices)


def _prompt_chunks(
    prompts: Sequence[Sequence[int]],
    choices: Sequence[Sequence[Sequence[int]]],
    token_budget: int,
    logit_budget: int,
    vocab: int,
) -> list[range]:
    """Consecutive prompt ranges whose forwards fit the budgets (at least one prompt each).

    Budgets per forward: rows x (prompt width + packed choice width) <= ``token_budget`` and
    rows x packed choice width x vocabulary <= ``logit_budget``.
    """
    chunks, start, width, feed = [], 0, 0, 0
    for b, prompt in enumerate(prompts):
        new_width, new_feed = max(width, len(prompt)), max(feed, _feed_length(choices[b]))
        rows = b - start + 1
        over = rows * (new_width + new_feed) > token_budget or rows * new_feed * vocab > logit_budget
        if b > start and over:
            chunks.append(range(start, b))
            start, new_width, new_feed = b, len(prompt), _feed_length(choices[b])
        width, feed = new_width, new_feed
    chunks.append(range(start, len(prompts)))
    return chunks


@torch.no_grad()
def score_choices_batch(
    model: PreTrainedModel,
    prompts_ids: Sequence[Sequence[int]],
    choices_ids: Sequence[Sequence[Sequence[int]]],
    *,
    pad_id: int = 0,
    token_budget: int = TOKEN_BUDGET,
    logit_budget: int = LOGIT_BUDGET,
    layout: str = "auto",
) -> list[list[np.ndarray]]:
    """Per-token log-probs [len(choice)] of every choice of every prompt, reusing each prompt's KV cache.

    ``prompts_ids[b]`` is a non-empty prompt; ``choices_ids[b][j]`` a non-empty token list. Returns
    ``out[b][j]`` float32 arrays with ``out[b][j][i] = log p(choice_ids[b][j][i] | prompt, choice[:i])``.

    ``layout``: ``packed`` runs all choices of a prompt as one sequence on top of that prompt's cache
    with a block-diagonal 4-D attention mask (no copy of the cache; needs the sdpa or eager attention
    implementation); ``expanded`` repeats the prompt cache once per choice and runs the choices as a
    right-padded batch (any attention implementation); ``auto`` picks packed when it can.
    """
    if len(prompts_ids) != len(choices_ids):
        raise ValueError("one list of choices per prompt")
    for b, (prompt, choices) in enumerate(zip(prompts_ids, choices_ids, strict=True)):
        if not len(prompt) or not len(choices) or any(not len(c) for c in choices):
            raise ValueError(f"prompt {b}: need a non-empty prompt and non-empty choices")
    attn = getattr(model.config, "_attn_implementation", None)
    if layout == "auto":
        layout = "packed" if attn in ("sdpa", "eager") else "expanded"
    if layout not in ("packed", "expanded"):
        raise ValueError(f"layout must be auto, packed or expanded, not {layout!r}")
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    out: list[list[np.ndarray]] = [[] for _ in prompts_ids]
    for chunk in _prompt_chunks(prompts_ids, choices_ids, token_budget, logit_budget, vocab):
        ids, mask, positions = left_pad([prompts_ids[b] for b in chunk], pad_id, device)
        logits, cache = forward_with_cache(
            model,
            DynamicCache(),
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=1,
        )
        first_logp = torch.log_softmax(logits[:, -1].float(), dim=-1)  # [B, V]: p(first choice token)
        if layout == "packed":
            scored = _score_packed(
                model, cache, first_logp, mask, [choices_ids[b] for b in chunk], pad_id, attn
            )
            for b, per_choice in zip(chunk, scored, strict=True):
                out[b] = per_choice
            continue
        rows = [(local, b, j) for local, b in enumerate(chunk) for j in range(len(choices_ids[b]))]
        width = ids.shape[1]
        max_len = max(len(c) for b in chunk for c in choices_ids[b])
        per_row = max(1, width + max_len)
        rows_per_forward = max(1, min(token_budget // per_row, logit_budget // max(1, max_len * vocab)))
        for start in range(0, len(rows), rows_per_forward):
            part = rows[start : start + rows_per_forward]
            scored_rows = _score_rows(model, cache, first_logp, mask, part, choices_ids, pad_id, device)
            for (_, b, _), lp in zip(part, scored_rows, strict=True):
                out[b].append(lp)
    return out


def _score_packed(
    model: PreTrainedModel,
    prompt_cache: DynamicCache,
    first_logp: torch.Tensor,
    prompt_mask: torch.Tensor,
    choices: Sequence[Sequence[Sequence[int]]],
    pad_id: int,
    attn: str | None,
) -> list[list[np.ndarray]]:
    """Score every prompt's choices packed into one sequence on top of its (uncopied) prompt cache.

    Packed sequence of prompt b: choice 0 without its last token, then choice 1 without its last
    token, ...; token i of choice j sits at position len(prompt_b) + i and attends to the prompt and
    to choice j's earlier tokens only, so its logits equal those of prompt + choice_j alone.
    """
    device = first_logp.device
    n = len(choices)
    feeds = [[t for c in cs for t in c[:-1]] for cs in choices]
    width = max(len(f) for f in feeds)
    result: list[list[np.ndarray]] = []
    if width == 0:  # only single-token choices: the prompt's last logits say everything
        for b, cs in enumerate(choices):
            lp = first_logp[b, torch.tensor([c[0] for c in cs], device=device)].cpu().numpy()
            result.append([np.array([x], dtype=np.float32) for x in lp])
        return result
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.zeros((n, width), dtype=torch.long)
    segment = torch.full((n, width), -1, dtype=torch.long)
    offset = torch.zeros((n, width), dtype=torch.long)
    for b, cs in enumerate(choices):
        k = 0
        for j, c in enumerate(cs):
            m = len(c) - 1
            if m:
                tokens[b, k : k + m] = torch.as_tensor(c[:-1])
                targets[b, k : k + m] = torch.as_tensor(c[1:])
                segment[b, k : k + m] = j
                offset[b, k : k + m] = torch.arange(m)
                k += m
    tokens, targets, segment, offset = (x.to(device) for x in (tokens, targets, segment, offset))
    prompt_len = prompt_mask.sum(-1)  # [B]
    positions = prompt_len[:, None] + offset
    # keys: the prompt's real positions, then earlier packed tokens of the same choice
    idx = torch.arange(width, device=device)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    causal = idx[None, :, None] >= idx[None, None, :]
    allowed = torch.cat([prompt_mask.bool()[:, None, :].expand(n, width, -1), same & causal], dim=2)[
        :, None
    ]  # [B, 1, F, P + F]; padding queries see the prompt only (no empty rows)
    if attn == "eager":
        mask4d = torch.zeros(allowed.shape, dtype=model.dtype, device=device)
        mask4d.masked_fill_(~allowed, torch.finfo(model.dtype).min)
    else:
        mask4d = allowed
    logits, _ = forward_with_cache(
        model, prompt_cache, input_ids=tokens, attention_mask=mask4d, position_ids=positions
    )
    later = torch.log_softmax(logits.float(), dim=-1).gather(2, targets[:, :, None]).squeeze(2).cpu().numpy()
    first = first_logp.cpu().numpy()
    for b, cs in enumerate(choices):
        per_choice, k = [], 0
        for c in cs:
            m = len(c) - 1
            per_choice.append(np.concatenate([[first[b, c[0]]], later[b, k : k + m]]).astype(np.float32))
            k += m
        result.append(per_choice)
    return result


def _score_rows(
    model: PreTrainedModel,
    prompt_cache: DynamicCache,
    first_logp: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: list[tuple[int, int, int]],
    choices_ids: Sequence[Sequence[Sequence[int]]],
    pad_id: int,
    device: torch.device,
) -> list[np.ndarray]:
    """Score choice rows (local prompt index, prompt, choice) against the prefilled prompt cache."""
    local = torch.tensor([r[0] for r in rows], device=device)
    seqs = [list(choices_ids[b][j]) for _, b, j in rows]
    lengths = [len(s) for s in seqs]
    max_len = max(lengths)
    tokens = torch.full((len(rows), max_len), pad_id, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    tokens = tokens.to(device)
    # log p of each choice's first token comes from the prompt's last position
    logp = [first_logp.index_select(0, local).gather(1, tokens[:, :1])]
    if max_len > 1:
        # feed all but the last choice token; position i predicts choice token i + 1
        feed = tokens[:, :-1]
        feed_mask = torch.zeros_like(feed)
        for i, n in enumerate(lengths):
            feed_mask[i, : n - 1] = 1
        mask = torch.cat([prompt_mask.index_select(0, local), feed_mask], dim=1)
        start = prompt_mask.sum(-1).index_select(0, local)  # each prompt's real length
        positions = start[:, None] + torch.arange(max_len - 1, device=device)[None, :]
        logits, _ = forward_with_cache(
            model,
            _select_cache(prompt_cache, local),
            input_ids=feed,
            attention_mask=mask,
            position_ids=positions,
        )
        logp.append(torch.log_softmax(logits.float(), dim=-1).gather(2, tokens[:, 1:, None]).squeeze(2))
    all_logp = torch.cat(logp, dim=1).cpu().numpy().astype(np.float32)
    return [all_logp[i, :n].copy() for i, n in enumerate(lengths)]


def choice_distribution(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    choices_ids: Sequence[Sequence[int]],
    temperature: float,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """π(·|s) over the choices and the per-token log-probs of each choice (no grad, KV-cache reuse).

    Returns ``(log_probs_over_choices [K] float64, [lp_j [len(choice_j)] float32 for each j])`` with
    ``log_probs_over_choices = log_softmax(mean(lp_j) / temperature)`` — see the module docstring for
    the exact convention the update stage mirrors.
    """
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    per_token = score_choices_batch(model, [prompt_ids], [choices_ids], pad_id=pad)[0]
    means = np.array([lp.mean(dtype=np.float64) for lp in per_token])
    return torch.from_numpy(choice_log_probs(means, temperature)), [torch.from_numpy(lp) for lp in per_token]
