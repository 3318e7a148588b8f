"""The update's experimental options: the entropy bonus and dropping groups whose credit is all zero,
against hand values and independent computations."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from schemas.config import UpdateConfig
from stages.update.batching import drop_flat_groups
from stages.update.loss import grpo_c_terms, grpo_token_terms
from stages.update.trainer import choice_entropy
from tests.helpers.tiny_qwen import tiny_qwen2
from tests.helpers.update_rows import rows_for

torch.set_num_threads(1)


def test_choice_entropy_is_the_entropy_of_each_rows_distribution_with_padding() -> None:
    p0 = [0.5, 0.25, 0.25]
    p1 = [0.9, 0.1]
    log_probs = torch.tensor([[math.log(p) for p in p0], [math.log(p1[0]), math.log(p1[1]), -math.inf]])
    want = [-sum(p * math.log(p) for p in p0), -sum(p * math.log(p) for p in p1)]
    assert choice_entropy(log_probs).tolist() == pytest.approx(want, abs=1e-6)


def test_entropy_bonus_enters_both_objectives_as_minus_c_times_entropy() -> None:
    log_ratio = torch.tensor([0.1, -0.05], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    row_h = torch.tensor([0.7, 1.3], dtype=torch.float64)
    plain = grpo_c_terms(log_ratio, adv, None, mask, 0.2, 0.2, 0.0)
    bonus = grpo_c_terms(log_ratio, adv, None, mask, 0.2, 0.2, 0.0, row_h, 0.01)
    assert plain.entropy_sum is None
    assert float(bonus.entropy_sum) == pytest.approx(2.0)
    assert float(bonus.loss_sum) == pytest.approx(float(plain.loss_sum) - 0.01 * 2.0)
    assert float(bonus.policy_sum) == pytest.approx(float(plain.policy_sum))

    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64)
    tok_h = torch.tensor([[0.5, 0.25], [2.0, 9.0]], dtype=torch.float64)  # 9.0 sits on padding
    plain = grpo_token_terms(logp, logp, adv, None, mask, 0.2, 0.2, 0.0)
    bonus = grpo_token_terms(logp, logp, adv, None, mask, 0.2, 0.2, 0.0, tok_h, 0.1)
    assert float(bonus.entropy_sum) == pytest.approx(2.75)  # padding does not count
    assert float(bonus.loss_sum) == pytest.approx(float(plain.loss_sum) - 0.1 * 2.75)


def _one_sgd_step(rows, **cfg) -> list[torch.Tensor]:
    from stages.update.distributed import DistContext
    from stages.update.trainer import score_all_rows, train_policy

    torch.manual_seed(0)
    model = tiny_qwen2()
    ucfg = UpdateConfig(**{"lr": 1.0, "minibatch_size": 8, "epochs": 1, "beta": 0.0, "grad_clip": 0.0, **cfg})
    ctx = DistContext()
    old = score_all_rows(model, rows, 1.0, ucfg.max_tokens_per_batch, ctx)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train_policy(model, rows, old, None, ucfg, 1.0, np.random.default_rng(0), ctx, opt)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def assert_step_is_scaled_gradient(
    delta: list[torch.Tensor], objective: torch.Tensor, model: torch.nn.Module, scale: float
) -> None:
    """The SGD step (lr 1) equals ``scale * grad objective`` parameter by parameter, and moved something."""
    grads = torch.autograd.grad(objective, list(model.parameters()), allow_unused=True)
    for d, g in zip(delta, grads, strict=True):
        want = torch.zeros_like(d) if g is None else scale * g
        assert torch.allclose(d, want, atol=1e-6), (d.abs().max(), want.abs().max())
    assert any(float(d.abs().max()) > 0 for d in delta)


PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
RESPONSES = [[10, 11], [20]]
CHOICES = [[[10, 11], [12, 13, 14]], [[20], [21, 22]]]


def test_choose_rows_bonus_step_is_the_gradient_of_the_mean_choice_entropy() -> None:
    """With A = 0, one SGD step at lr 1 moves the weights by +c * grad (1/R) sum_i H(pi(.|s_i)),
    H computed here from the public choice distribution (stages.update.logprobs.choice_log_probs)."""
    from stages.update.logprobs import choice_log_probs

    c = 0.05
    delta = _one_sgd_step(rows_for(PROMPTS, RESPONSES, [0.0, 0.0], CHOICES), entropy_coef=c)
    torch.manual_seed(0)
    model = tiny_qwen2()
    lp = choice_log_probs(model, PROMPTS, CHOICES).log_probs
    p = lp.exp()
    entropy = -(torch.where(torch.isfinite(lp), p * lp, torch.zeros_like(lp))).sum(-1).mean()
    assert_step_is_scaled_gradient(delta, entropy, model, c)


def test_token_rows_bonus_step_is_the_gradient_of_the_mean_token_entropy() -> None:
    """With A = 0 the step is +c * grad (1/R) sum_i mean_t H_it, H from the model's logits computed
    here by hand (full vocabulary at each response position); without the bonus nothing moves."""
    rows = rows_for(PROMPTS, RESPONSES, [0.0, 0.0])
    assert all(float(d.abs().max()) == 0.0 for d in _one_sgd_step(rows))  # no bonus: A = 0 moves nothing
    c = 0.5
    delta = _one_sgd_step(rows, entropy_coef=c)
    torch.manual_seed(0)
    model = tiny_qwen2()
    per_row = []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
        log_p = torch.log_softmax(logits.float(), -1)
        per_row.append(-(log_p.exp() * log_p).sum(-1).mean())
    entropy = torch.stack(per_row).mean()
    assert_step_is_scaled_gradient(delta, entropy, model, c)


def test_drop_flat_groups_keeps_groups_with_any_nonzero_credit() -> None:
    joined = pl.DataFrame(
        {
            "group_id": ["a", "a", "b", "b", "c"],
            "traj_id": ["a0", "a1", "b0", "b1", "c0"],
            "step": [0, 0, 0, 0, 0],
            "advantage": [0.0, 0.0, 0.0, -0.3, 0.0],
        }
    )
    assert drop_flat_groups(joined)["traj_id"].to_list() == ["b0", "b1"]
    flat = joined.with_columns(pl.lit(0.0).alias("advantage"))
    assert drop_flat_groups(flat).equals(flat)  # every group flat: nothing is dropped


def test_skip_flat_groups_trains_as_if_the_flat_group_were_absent(tmp_path) -> None:
    """The update with the option on a table with a flat group = the update without it on the table
    without that group (same rows, same denominator, same weights)."""
    from stages.update.runner import run_update
    from tests.helpers.update_rows import make_run

    run_a, config_a = make_run(tmp_path / "a", skip_flat_groups=True, beta=0.0)
    adv = run_a.read(0, "advantages")
    first = adv["group_id"][0]
    flat = adv.with_columns(
        pl.when(pl.col("group_id") == first).then(0.0).otherwise(pl.col("advantage")).alias("advantage")
    )
    run_a.write(0, "advantages", flat)
    run_update(run_a, 0, config_a)

    run_b, config_b = make_run(tmp_path / "b", beta=0.0)
    keep = flat["group_id"] != first
    run_b.write(0, "steps", run_b.read(0, "steps").filter(keep))
    run_b.write(0, "advantages", flat.filter(keep))
    run_update(run_b, 0, config_b)

    from safetensors.torch import load_file

    a = load_file(str(run_a.checkpoint_dir(0) / "model.safetensors"))
    b = load_file(str(run_b.checkpoint_dir(0) / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(str(run_a.initial_model_dir / "model.safetensors"))
    assert any(not torch.equal(a[k], base[k]) for k in a)  # it did train
