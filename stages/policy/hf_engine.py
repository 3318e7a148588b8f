"""The ``hf`` policy engine: transformers on CPU or GPU (docs/design.md §6).

``generate`` is a hand-written sampling loop rather than ``model.generate`` because the rollout needs,
per row, the log-prob of every sampled token under the sampling distribution, per-row stop strings,
and one seeded stream per row. Prompts are left-padded; finished rows are dropped from the batch and
the KV cache (``Cache.batch_select_indices``), so they cost nothing.

Sampling is batch-independent: each row owns a CPU ``torch.Generator`` seeded with its ``seeds[i]``
and draws one uniform per generated token; the token is the inverse CDF of the row's sampling
distribution at that uniform (one vectorized ``searchsorted`` for the batch). A row's draws thus
depend only on its own seed and its own tokens, never on which rows share the batch, and a tiny
float difference from another padding moves the pick only if the uniform falls within it of a CDF
boundary (CPU generators also make the draws the same on every device).

Log-probs stored for generated tokens are those of the distribution actually sampled,
``log_softmax(logits / T)`` (T = 1.0 is the raw model); greedy decoding (T <= 0) stores the raw
model's log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging

from stages.policy.choice import LOGIT_BUDGET, TOKEN_BUDGET, left_pad, score_choices_batch
from stages.policy.engine import STOP_STRINGS, EngineOptions, Generation, check_seeds
from stages.policy.models import (
    forward_with_cache,
    load_causal_lm,
    load_tokenizer,
    prompt_format,
    resolve_device,
)

STOP_TAIL_TOKENS = 16  # decoded tail length checked for stop strings


def sample_rows(logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the first token j with cdf[j] > u · cdf[V-1].

    ``logp`` [B, V] log-probs of each row's sampling distribution; ``uniforms`` [B] in [0, 1), one per
    row. Returns token ids [B] (long). The CDF is accumulated in float64 so a 150k-token vocabulary
    does not bias the tail; ``side="right"`` never returns a zero-probability token.
    """
    cdf = logp.exp().double().cumsum(-1)
    target = (uniforms.to(cdf.device, torch.float64) * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return chosen.clamp_(max=logp.shape[-1] - 1)


class HFEngine:
    """A transformers model acting as the policy."""

    name = "hf"

    def __init__(self, model_dir: Path, version: str, options: EngineOptions) -> None:
        hf_logging.disable_progress_bar()
        self.options = options
        self.device = resolve_device(options.device)
        self.model_dir: Path | None = None
        self.policy_version = version
        self.load(model_dir, version)

    def load(self, model_dir: Path, version: str) -> None:
        self.policy_version = version
        if self.model_dir is not None and Path(model_dir).resolve() == self.model_dir.resolve():
            return
        self.model = load_causal_lm(
            model_dir,
            device=self.device,
            dtype=self.options.dtype,
            trust_remote_code=self.options.trust_remote_code,
        )
        self.tokenizer = load_tokenizer(model_dir, self.options.trust_remote_code)
        self.prompt_format = prompt_format(self.model, self.tokenizer, self.options.prompt_format)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=self.device)
        self._stop_candidates: dict[tuple[str, ...], torch.Tensor] = {}
        self.model_dir = Path(model_dir)

    def score_choices(
        self, prompts_ids: Sequence[Sequence[int]], choices_ids: Sequence[Sequence[Sequence[int]]]
    ) -> list[list[np.ndarray]]:
        return score_choices_batch(
            self.model,
            prompts_ids,
            choices_ids,
            pad_id=self.pad_id,
            token_budget=int(self.options.extra.get("token_budget", TOKEN_BUDGET)),
            logit_budget=int(self.options.extra.get("logit_budget", LOGIT_BUDGET)),
        )

    def _may_end_stop(self, stop: tuple[str, ...]) -> torch.Tensor:
        """Bool [V]: tokens whose text contains the last character of a stop string (cached)."""
        if stop not in self._stop_candidates:
            last_chars = {s[-1] for s in stop}
            vocab = self.model.config.get_text_config().vocab_size
            texts = self.tokenizer.batch_decode([[i] for i in range(min(vocab, len(self.tokenizer)))])
            flags = torch.zeros(vocab, dtype=torch.bool)
            for i, text in enumerate(texts):
                flags[i] = any(c in text for c in last_chars)
            self._stop_candidates[stop] = flags.to(self.device)
        return self._stop_candidates[stop]

    @torch.no_grad()
    def generate(
        self,
        prompts_ids: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        stop: Sequence[str] = STOP_STRINGS,
        seeds: Sequence[int],
    ) -> list[Generation]:
        row_seeds = check_seeds(prompts_ids, seeds)
        n = len(prompts_ids)
        if n == 0:
            return []
        stop = tuple(stop)
        may_stop = self._may_end_stop(stop) if stop else None
        # one stream per original row (CPU: cheap scalar draws, identical on every device)
        generators = [torch.Generator(device="cpu").manual_seed(s) for s in row_seeds]
        ids, mask, positions = left_pad(prompts_ids, self.pad_id, self.device)
        logits, cache = forward_with_cache(
            self.model,
            DynamicCache(),
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=1,
        )
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        active = torch.arange(n, device=self.device)  # original row of each batch row
        next_pos = positions[:, -1] + 1
        for step in range(max_new_tokens):
            last = logits[:, -1].float()
            if temperature > 0:
                logp = torch.log_softmax(last / temperature, dim=-1)
                uniforms = torch.cat([torch.rand(1, generator=generators[row]) for row in active.tolist()])
                chosen = sample_rows(logp, uniforms)
            else:
                logp = torch.log_softmax(last, dim=-1)
                chosen = logp.argmax(-1)
            chosen_logp = logp.gather(1, chosen[:, None]).squeeze(1)
            finished = torch.isin(chosen, self.eos_ids)
            check = may_stop[chosen] & ~finished if may_stop is not None else None
            rows = active.tolist()
            for b, (row, tok, lp) in enumerate(zip(rows, chosen.tolist(), chosen_logp.tolist(), strict=True)):
                tokens[row].append(tok)
                logps[row].append(lp)
                if finished[b]:
                    reasons[row] = "eos"
                elif check is not None and check[b]:
                    tail = self.tokenizer.decode(tokens[row][-STOP_TAIL_TOKENS:], skip_special_tokens=True)
                    if any(s in tail for s in stop):
                        reasons[row] = "stop"
                        finished[b] = True
            if step == max_new_tokens - 1:
                break
            keep = (~finished).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            if keep.numel() < active.numel():
                cache.batch_select_indices(keep)
                active, mask, next_pos, chosen = active[keep], mask[keep], next_pos[keep], chosen[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits, cache = forward_with_cache(
                self.model,
                cache,
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
            )
            next_pos = next_pos + 1
        return [
            Generation(
                response_ids=tokens[i],
                response_logprobs=logps[i],
                text=self.tokenizer.decode(tokens[i], skip_special_tokens=True),
                finish_reason=reasons[i],
            )
            for i in range(n)
        ]

    def release(self) -> bool:
        return False  # a transformers model has no sleep: the loop closes it and reloads later

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
