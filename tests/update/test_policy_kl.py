"""Exact KL(π_new ‖ π_old) of an update (stages.update.policy_kl) against a plain full-logits reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.update.policy_kl import exact_kl, kl_summary, probe_indices, row_distributions
from tests.helpers.update_rows import ACTIONS, TEXTS, make_run, make_tokenizer, rows_for, update_values

torch.set_num_threads(1)


def _model(seed: int):
    from stages.policy.tiny import TinySpec, random_qwen2

    return random_qwen2(
        make_tokenizer(), spec=TinySpec(hidden=32, layers=1, heads=2, max_positions=512), seed=seed
    )


def _reference_token_kl(new, old, prompt: list[int], response: list[int], temperature: float) -> float:
    """Σ over response positions of the full-vocabulary KL(new ‖ old), from whole-sequence logits."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        positions = range(len(prompt) - 1, len(prompt) - 1 + len(response))
        ln = torch.log_softmax(new(input_ids=ids).logits[0, list(positions)].double() / temperature, -1)
        lo = torch.log_softmax(old(input_ids=ids).logits[0, list(positions)].double() / temperature, -1)
    return float((ln.exp() * (ln - lo)).sum())


def _reference_choice_kl(new, old, prompt: list[int], choices: list[list[int]], temperature: float) -> float:
    """KL over softmax_j(mean token log-prob of choice j / T), each choice scored on its own."""

    def dist(model):
        means = []
        for c in choices:
            ids = torch.tensor([prompt + c])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            means.append(float(sum(lp[len(prompt) - 1 + k, tok] for k, tok in enumerate(c)) / len(c)))
        return torch.log_softmax(torch.tensor(means, dtype=torch.float64) / temperature, 0)

    ln, lo = dist(new), dist(old)
    return float((ln.exp() * (ln - lo)).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_exact_kl_equals_a_full_logits_reference(temperature):
    tok = make_tokenizer()
    old, new = _model(0), _model(1)
    prompts = [tok.encode(TEXTS[0] + " " + TEXTS[k], add_special_tokens=False) for k in (8, 9, 8)]
    responses = [tok.encode(a, add_special_tokens=False) for a in ACTIONS[:3]]
    choices = [[tok.encode(a, add_special_tokens=False) for a in ACTIONS[:4]] for _ in prompts]
    for with_choices in (False, True):
        rows = rows_for(prompts, responses, [1.0, -1.0, 0.5], choices if with_choices else None)
        probe = np.arange(rows.n)
        before = row_distributions(old, rows, probe, temperature)
        kl = exact_kl(row_distributions(new, rows, probe, temperature), before)
        if with_choices:
            ref = [
                _reference_choice_kl(new, old, p, c, temperature)
                for p, c in zip(prompts, choices, strict=True)
            ]
        else:
            ref = [
                _reference_token_kl(new, old, p, r, temperature)
                for p, r in zip(prompts, responses, strict=True)
            ]
        np.testing.assert_allclose(kl, ref, rtol=1e-4, atol=1e-6)
        assert (kl > 0).all()
        np.testing.assert_allclose(exact_kl(before, before), 0.0, atol=1e-7)  # the same policy


def test_probe_is_a_seeded_sample_and_the_summary_names_its_size():
    rng = np.random.default_rng
    assert probe_indices(5, 128, rng(0)).tolist() == [0, 1, 2, 3, 4]
    a, b = probe_indices(1000, 16, rng(3)), probe_indices(1000, 16, rng(3))
    assert a.tolist() == b.tolist() and len(set(a.tolist())) == 16 and (np.diff(a) > 0).all()
    assert probe_indices(10, 0, rng(0)).size == 0 and kl_summary(np.zeros(0), 0) == {}
    summary = kl_summary(np.array([0.0, 1.0, 3.0]), tokens=8)
    assert summary["policy_kl"] == pytest.approx(4 / 3) and summary["policy_kl_max"] == 3.0
    assert summary["policy_kl_token"] == pytest.approx(0.5) and summary["policy_kl_rows"] == 3


@pytest.mark.parametrize("mode", ["choose", "generate"])
def test_the_update_logs_how_far_it_moved_the_policy(tmp_path, mode):
    from stages.update import run_update

    kls = {}
    for lr in (0.0, 3e-3, 3e-2):
        run, config = make_run(tmp_path / f"{mode}-{lr}", mode, lr=lr, beta=0.0)
        run_update(run, 0, config)
        table = update_values(run)
        kls[lr] = table[(-1, -1, "policy_kl")]
        assert table[(-1, -1, "policy_kl_rows")] == 12  # every row of the small batch
        assert table[(-1, -1, "policy_kl_max")] >= table[(-1, -1, "policy_kl")]
    assert kls[0.0] == pytest.approx(0.0, abs=1e-6)
    assert 0 < kls[3e-3] < kls[3e-2]


def test_probe_off_writes_no_kl(tmp_path):
    from stages.update import run_update

    run, config = make_run(tmp_path, "choose", kl_probe_rows=0)
    run_update(run, 0, config)
    assert not any(name.startswith("policy_kl") for (_, _, name) in update_values(run))


def test_probe_does_not_change_the_update(tmp_path):
    from stages.update import run_update

    weights = []
    for rows in (0, 128):
        run, config = make_run(tmp_path / str(rows), "generate", kl_probe_rows=rows)
        run_update(run, 0, config)
        from safetensors.torch import load_file

        weights.append(load_file(str(run.checkpoint_dir(0) / "model.safetensors")))
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=0)
