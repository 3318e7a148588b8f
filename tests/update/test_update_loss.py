"""GRPO-C / GRPO losses and log-prob layouts of the update stage, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.update.logprobs import choice_log_probs, response_log_probs
from stages.update.loss import grpo_c_terms, grpo_token_terms, k3_kl, policy_loss, sequence_log_ratio
from tests.helpers.tiny_qwen import tiny_qwen2

torch.set_num_threads(1)

# Four rows, response lengths 2, 1, 3, 2 (padded to 3); exercised sides of the clip:
#   row 0: A > 0, w above 1 + clip_high   -> clipped (high side)
#   row 1: A < 0, w below 1 - clip_low    -> clipped (low side)
#   row 2: A > 0, w = 1                   -> not clipped
#   row 3: A > 0, w below 1 - clip_low    -> not clipped (min picks w A)
LOGP = [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -1.0], [-2.0, -1.5, 0.0]]
OLD = [[-1.2, -2.1, 0.0], [-0.2, 0.0, 0.0], [-1.1, -0.9, -1.0], [-1.5, -1.0, 0.0]]
REF = [[-1.1, -2.5, 0.0], [-0.5, 0.0, 0.0], [-0.7, -1.2, -1.0], [-2.0, -1.0, 0.0]]
LENS = [2, 1, 3, 2]
ADV = [1.0, -2.0, 0.5, 1.0]
CLIP_LOW, CLIP_HIGH, BETA = 0.2, 0.1, 0.05


def _tensors():
    mask = torch.tensor([[k < n for k in range(3)] for n in LENS])
    return (
        torch.tensor(LOGP, dtype=torch.float64),
        torch.tensor(OLD, dtype=torch.float64),
        torch.tensor(REF, dtype=torch.float64),
        mask,
        torch.tensor(ADV, dtype=torch.float64),
    )


def _k3(logp: float, ref: float) -> float:
    d = ref - logp
    return math.exp(d) - d - 1.0


def _hand_grpo_c() -> tuple[float, float, float, int]:
    """Eq. 3-4 with plain floats: (loss, policy loss, kl, clipped rows)."""
    pg, kl, clipped = [], [], 0
    for logp, old, ref, n, a in zip(LOGP, OLD, REF, LENS, ADV, strict=True):
        w = math.exp(sum(logp[t] - old[t] for t in range(n)) / n)
        w_clip = min(max(w, 1 - CLIP_LOW), 1 + CLIP_HIGH)
        pg.append(-min(w * a, w_clip * a))
        clipped += int(w_clip * a < w * a)
        kl.append(sum(_k3(logp[t], ref[t]) for t in range(n)) / n)
    policy = sum(pg) / len(pg)
    kl_mean = sum(kl) / len(kl)
    return policy + BETA * kl_mean, policy, kl_mean, clipped


def test_grpo_c_matches_hand_computation():
    logp, old, ref, mask, adv = _tensors()
    loss, terms = policy_loss("grpo_c", logp, old, ref, mask, adv, CLIP_LOW, CLIP_HIGH, BETA)
    want_loss, want_policy, want_kl, want_clipped = _hand_grpo_c()
    assert float(loss) == pytest.approx(want_loss, abs=1e-12)
    assert float(terms.policy_sum) / 4 == pytest.approx(want_policy, abs=1e-12)
    assert float(terms.kl_sum) / 4 == pytest.approx(want_kl, abs=1e-12)
    assert int(terms.clipped.sum()) == want_clipped == 2
    assert terms.clipped.tolist() == [True, True, False, False]
    # the rows' ratios themselves: row 0 w = exp((0.2 + 0.1) / 2)
    assert float(terms.ratio[0]) == pytest.approx(math.exp(0.15), abs=1e-12)
    assert float(terms.ratio[1]) == pytest.approx(math.exp(-0.3), abs=1e-12)


def test_grpo_token_matches_hand_computation():
    logp, old, ref, mask, adv = _tensors()
    loss, terms = policy_loss("grpo", logp, old, ref, mask, adv, CLIP_LOW, CLIP_HIGH, BETA)
    pg, kl, clipped = [], [], 0
    for lp, o, rf, n, a in zip(LOGP, OLD, REF, LENS, ADV, strict=True):
        for t in range(n):
            r = math.exp(lp[t] - o[t])
            r_clip = min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            pg.append(-min(r * a, r_clip * a))
            clipped += int(r_clip * a < r * a)
            kl.append(_k3(lp[t], rf[t]))
    assert terms.units == sum(LENS) == len(pg)
    assert float(loss) == pytest.approx((sum(pg) + BETA * sum(kl)) / len(pg), abs=1e-12)
    assert int(terms.clipped.sum()) == clipped


def test_token_objective_differs_from_grpo_c_when_lengths_differ():
    logp, old, ref, mask, adv = _tensors()
    a, _ = policy_loss("grpo_c", logp, old, ref, mask, adv, CLIP_LOW, CLIP_HIGH, 0.0)
    b, _ = policy_loss("grpo", logp, old, ref, mask, adv, CLIP_LOW, CLIP_HIGH, 0.0)
    assert abs(float(a) - float(b)) > 1e-3


def test_gradient_of_grpo_c_is_cut_exactly_on_clipped_rows():
    logp, old, ref, mask, adv = _tensors()
    logp.requires_grad_(True)
    loss, _ = policy_loss("grpo_c", logp, old, ref, mask, adv, CLIP_LOW, CLIP_HIGH, 0.0)
    loss.backward()
    grad = logp.grad
    assert torch.all(grad[0] == 0) and torch.all(grad[1] == 0)  # clipped
    # unclipped row i: d(-w A / R)/d logp_t = -w A / (R n) on each of its tokens, 0 on padding
    for i in (2, 3):
        n = LENS[i]
        w = math.exp(sum(LOGP[i][t] - OLD[i][t] for t in range(n)) / n)
        want = [-w * ADV[i] / (4 * n) if t < n else 0.0 for t in range(3)]
        assert grad[i].tolist() == pytest.approx(want, abs=1e-12)


def test_zero_advantage_gives_no_policy_gradient():
    logp, old, ref, mask, _ = _tensors()
    logp.requires_grad_(True)
    loss, _ = policy_loss("grpo_c", logp, old, ref, mask, torch.zeros(4, dtype=torch.float64), 0.2, 0.2, 0.0)
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_kl_is_zero_against_itself_and_nonnegative():
    logp, _, ref, mask, adv = _tensors()
    assert torch.all(k3_kl(logp, logp) == 0)
    _, terms = policy_loss("grpo_c", logp, logp, logp, mask, adv, 0.2, 0.2, 1.0)
    assert float(terms.kl_sum) == 0.0
    assert torch.all(k3_kl(logp, ref) >= 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-6, 0), min_size=1, max_size=6),
    st.lists(st.floats(-6, 0), min_size=1, max_size=6),
)
def test_k3_is_an_unbiased_kl_estimator_form(a, b):
    """k3(x, y) = min(exp(y - x) - (y - x) - 1, 10) >= 0 (elementwise, clamped as in verl)."""
    n = min(len(a), len(b))
    x, y = torch.tensor(a[:n], dtype=torch.float64), torch.tensor(b[:n], dtype=torch.float64)
    kl = k3_kl(x, y)
    want = [min(math.exp(v - u) - (v - u) - 1, 10.0) for u, v in zip(a[:n], b[:n], strict=True)]
    assert kl.tolist() == pytest.approx(want, abs=1e-9)
    assert torch.all(kl >= -1e-15)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.data())
def test_split_sums_equal_whole_batch(split, data):
    """Sums over micro-batches divided by the global count = the whole-batch mean (both objectives)."""
    logp, old, ref, mask, adv = _tensors()
    cut = data.draw(st.integers(1, 3)) if split > 1 else 4
    kl = k3_kl(logp, ref)
    parts = [slice(0, cut), slice(cut, 4)]
    whole = grpo_c_terms(sequence_log_ratio(logp, old, mask), adv, kl, mask, 0.2, 0.2, BETA)
    total = sum(
        float(
            grpo_c_terms(
                sequence_log_ratio(logp[p], old[p], mask[p]), adv[p], kl[p], mask[p], 0.2, 0.2, BETA
            ).loss_sum
        )
        for p in parts
    )
    assert total / 4 == pytest.approx(float(whole.loss_sum) / 4, abs=1e-12)
    whole_t = grpo_token_terms(logp, old, adv, kl, mask, 0.2, 0.2, BETA)
    total_t = sum(
        float(grpo_token_terms(logp[p], old[p], adv[p], kl[p], mask[p], 0.2, 0.2, BETA).loss_sum)
        for p in parts
    )
    assert total_t == pytest.approx(float(whole_t.loss_sum), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# log-prob layouts against a naive one-sequence-at-a-time reference


def _naive_token_logprobs(model, prompt, cont, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + cont])).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + k, cont[k]]) for k in range(len(cont))]


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3]]
CHOICES = [[[10, 11], [12], [13, 14, 15]], [[20], [21, 22]], [[5, 6, 7, 8], [9], [40], [41, 42]]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_choice_log_probs_equal_per_choice_forward(attn):
    model = tiny_qwen2(attn=attn)
    t = 0.7
    with torch.no_grad():
        scores = choice_log_probs(model, PROMPTS, CHOICES, t)
    for b, (p, cs) in enumerate(zip(PROMPTS, CHOICES, strict=True)):
        means = [sum(_naive_token_logprobs(model, p, c)) / len(c) for c in cs]
        z = [m / t for m in means]
        log_norm = math.log(sum(math.exp(v) for v in z))
        want = [v - log_norm for v in z]
        assert scores.log_probs[b, : len(cs)].tolist() == pytest.approx(want, abs=1e-5)
        assert torch.all(torch.isinf(scores.log_probs[b, len(cs) :]))


def test_choice_log_probs_are_differentiable():
    model = tiny_qwen2(attn="sdpa")
    scores = choice_log_probs(model, PROMPTS, CHOICES, 1.0)
    scores.log_probs[0, 1].backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)


def test_choice_log_probs_agree_with_rollout_choice_distribution():
    from stages.policy.choice import choice_distribution

    model = tiny_qwen2(attn="sdpa")
    with torch.no_grad():
        scores = choice_log_probs(model, PROMPTS, CHOICES, 0.5)
    for b, (p, cs) in enumerate(zip(PROMPTS, CHOICES, strict=True)):
        rollout_lp, per_token = choice_distribution(model, p, cs, 0.5)
        assert scores.log_probs[b, : len(cs)].tolist() == pytest.approx(rollout_lp.tolist(), abs=1e-5)
        for j, tok in enumerate(per_token):
            assert scores.token_logprobs[b, j, : len(tok)].tolist() == pytest.approx(tok.tolist(), abs=1e-5)


def test_response_log_probs_equal_naive_forward_with_temperature():
    model = tiny_qwen2(attn="sdpa")
    responses = [[10, 11], [21, 22, 23], [4]]
    with torch.no_grad():
        logp, mask, entropy = response_log_probs(model, PROMPTS, responses, 0.8, with_entropy=True)
    for b, (p, r) in enumerate(zip(PROMPTS, responses, strict=True)):
        assert logp[b, : len(r)].tolist() == pytest.approx(_naive_token_logprobs(model, p, r, 0.8), abs=1e-5)
        assert mask[b].tolist() == [k < len(r) for k in range(3)]
    assert torch.all(entropy[mask] > 0) and torch.all(entropy[~mask] == 0)


def test_objectives_are_registered_with_the_unit_their_mean_divides_by():
    """One place per objective: its terms and its aggregation (rows for GRPO-C, tokens for GRPO)."""
    import numpy as np

    from stages.update.loss import OBJECTIVES, ScoredRows, objective

    assert {name: o.unit for name, o in OBJECTIVES.items()} == {"grpo_c": "rows", "grpo": "tokens"}
    lengths = np.array(LENS)
    assert objective("grpo_c").units(lengths) == 4 and objective("grpo").units(lengths) == sum(LENS)
    logp, old, _, mask, adv = _tensors()
    rows = ScoredRows(logp, old, mask, adv)
    for name in OBJECTIVES:
        terms = objective(name).terms(rows, CLIP_LOW, CLIP_HIGH, 0.0, 0.0)
        assert terms.units == objective(name).units(lengths)
    with pytest.raises(ValueError, match="unknown objective"):
        objective("ppo")
