"""Seeds and sampling for the policy.

Seeds follow docs/design.md: every random stream derives from ``numpy.random.SeedSequence`` of
(run seed, iteration, purpose, ...), with string parts hashed by CRC-32 so purposes are readable.
"""

from __future__ import annotations

import zlib

import numpy as np


def seed_parts(*parts: int | str) -> list[int]:
    """Entropy words for a SeedSequence: ints as given (must be >= 0), strings by CRC-32."""
    out = []
    for part in parts:
        if isinstance(part, str):
            out.append(zlib.crc32(part.encode()))
        elif part < 0:
            raise ValueError(f"seed part {part} must be >= 0")
        else:
            out.append(int(part))
    return out


def derive_rng(*parts: int | str) -> np.random.Generator:
    """A numpy Generator for the stream named by ``parts`` (e.g. seed, iteration, "rollout", group)."""
    return np.random.default_rng(np.random.SeedSequence(seed_parts(*parts)))


def derive_seed(*parts: int | str) -> int:
    """A 63-bit integer seed (for torch.Generator / vLLM) for the stream named by ``parts``."""
    state = np.random.SeedSequence(seed_parts(*parts)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def choice_log_probs(mean_logprobs: np.ndarray, temperature: float) -> np.ndarray:
    """log π(a_j|s) = log_softmax_j(m_j / T) over the admissible actions (docs/design.md §6 ``choose`` mode).

    ``mean_logprobs`` [K] holds m_j, the mean per-token log-prob of action j as a continuation of the
    prompt. ``temperature`` <= 0 is greedy: log-prob 0 on the first argmax, -inf elsewhere.
    """
    m = np.asarray(mean_logprobs, dtype=np.float64)
    if m.ndim != 1 or m.size == 0:
        raise ValueError("need a non-empty 1-D array of mean log-probs")
    if temperature <= 0:
        out = np.full(m.shape, -np.inf)
        out[int(np.argmax(m))] = 0.0
        return out
    z = m / temperature
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def sample_index(log_probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw j with probability exp(log_probs[j]) by inverse CDF on one uniform draw of ``rng``."""
    lp = np.asarray(log_probs, dtype=np.float64)
    p = np.exp(lp - lp.max())
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    # side="right": the first j with cdf[j] > u, so a zero-probability entry is never returned
    return min(int(np.searchsorted(cdf, u, side="right")), lp.size - 1)
