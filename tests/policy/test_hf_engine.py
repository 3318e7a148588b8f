"""The hf engine: KV-cache choice scoring vs plain forwards, the choose-mode policy, sampling, generation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from stages.policy.choice import choice_distribution, score_choices_batch
from stages.policy.engine import EngineOptions
from stages.policy.live_engine import build_engine
from stages.policy.sampling import choice_log_probs, derive_rng, sample_index
from stages.policy.tiny import TinySpec, build_tiny_model
from tests.helpers.rollout_fakes import CorridorEnv, corridor_prompt

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "model"
    build_tiny_model(
        path,
        CorridorEnv(),
        seed=1,
        spec=TinySpec(hidden=32, layers=1, heads=2),
        tasks_per_split=8,
        prompt_fn=corridor_prompt,
    )
    return build_engine("hf", Path(path), "initial", EngineOptions())


def _reference_logprobs(
    model, prompt: list[int], continuation: list[int], temperature: float = 1.0
) -> np.ndarray:
    """log p(continuation[i] | prompt + continuation[:i]) from one plain forward, no cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + continuation]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    rows = logp[len(prompt) - 1 : len(prompt) + len(continuation) - 1]
    return rows.gather(1, torch.tensor(continuation)[:, None]).squeeze(1).numpy()


def _prompt_and_choices(engine, n: int):
    tok = engine.tokenizer
    env = CorridorEnv(rooms=5)
    out = []
    for i, task in enumerate(env.tasks("train", n, 0)):
        game = env.new_game()
        obs = game.reset(task)
        text = (
            corridor_prompt(
                "alfworld",
                task_text=obs.task_text,
                observation=obs.text,
                admissible=obs.admissible,
                history=[("x", "look")] * i,
                step_count=i,
                history_length=2,
            )
            + "<action>"
        )
        choices = list(obs.admissible) + ["take key from room 4 now please"]
        out.append((tok(text)["input_ids"], [tok.encode(c, add_special_tokens=False) for c in choices]))
    return out


def test_kv_cache_scoring_equals_full_forward(engine) -> None:
    data = _prompt_and_choices(engine, 4)
    prompts, choices = [p for p, _ in data], [c for _, c in data]
    prompts[1] = prompts[1][:7]  # very different prompt lengths share one left-padded batch
    choices[2] = [c[:1] for c in choices[2]]  # a prompt whose choices are all single tokens
    budgets = ({}, {"token_budget": 60, "logit_budget": 4 * len(engine.tokenizer)})  # one chunk / many
    for layout in ("packed", "expanded"):
        for budget in budgets:
            scored = score_choices_batch(
                engine.model, prompts, choices, pad_id=engine.pad_id, layout=layout, **budget
            )
            for prompt, cs, got in zip(prompts, choices, scored, strict=True):
                assert len(got) == len(cs)
                for c, lp in zip(cs, got, strict=True):
                    assert lp.shape == (len(c),)
                    np.testing.assert_allclose(lp, _reference_logprobs(engine.model, prompt, c), atol=1e-4)


def test_packed_scoring_with_eager_attention(engine) -> None:
    data = _prompt_and_choices(engine, 2)
    prompts, choices = [p for p, _ in data], [c for _, c in data]
    engine.model.set_attn_implementation("eager")
    try:
        assert engine.model.config._attn_implementation == "eager"
        scored = score_choices_batch(engine.model, prompts, choices, pad_id=engine.pad_id, layout="packed")
        for prompt, cs, got in zip(prompts, choices, scored, strict=True):
            for c, lp in zip(cs, got, strict=True):
                np.testing.assert_allclose(lp, _reference_logprobs(engine.model, prompt, c), atol=1e-4)
    finally:
        engine.model.set_attn_implementation("sdpa")


def test_choice_distribution_is_softmax_of_mean_logprob(engine) -> None:
    prompt, choices = _prompt_and_choices(engine, 1)[0]
    for temperature in (1.0, 0.5):
        log_pi, per_token = choice_distribution(engine.model, prompt, choices, temperature)
        assert torch.exp(log_pi).sum().item() == pytest.approx(1.0, abs=1e-9)
        means = np.array([_reference_logprobs(engine.model, prompt, c).mean() for c in choices])
        z = means / temperature
        expected = z - np.log(np.exp(z - z.max()).sum()) - z.max()
        np.testing.assert_allclose(log_pi.numpy(), expected, atol=1e-4)
        for c, lp in zip(choices, per_token, strict=True):
            np.testing.assert_allclose(lp.numpy(), _reference_logprobs(engine.model, prompt, c), atol=1e-4)
    greedy, _ = choice_distribution(engine.model, prompt, choices, 0.0)
    assert greedy.exp().sum().item() == 1.0 and int(greedy.argmax()) == int(np.argmax(means))


def test_sampling_follows_the_choice_distribution() -> None:
    log_pi = choice_log_probs(np.array([-1.0, -2.5, -0.3, -4.0, -1.2]), temperature=0.8)
    rng = derive_rng(0, 1, "test")
    draws = np.array([sample_index(log_pi, rng) for _ in range(6000)])
    counts = np.bincount(draws, minlength=5)
    result = chisquare(counts, np.exp(log_pi) * draws.size)
    assert result.pvalue > 1e-3, (counts, np.exp(log_pi) * draws.size)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.one_of(st.floats(-30, 0), st.just(-np.inf)), min_size=1, max_size=8), st.integers(0, 2**32)
)
def test_sampling_never_draws_impossible_choices(values, seed) -> None:
    lp = np.array(values)
    if not np.isfinite(lp).any():
        lp[0] = 0.0
    j = sample_index(lp, np.random.default_rng(seed))
    assert 0 <= j < lp.size and np.isfinite(lp[j])


def test_generated_logprobs_match_a_fresh_forward(engine) -> None:
    prompts = [p for p, _ in _prompt_and_choices(engine, 3)]
    prompts[2] = prompts[2][:5]
    for temperature in (1.0, 0.7):
        gens = engine.generate(prompts, temperature=temperature, max_new_tokens=12, stop=(), seeds=[5, 6, 7])
        for prompt, gen in zip(prompts, gens, strict=True):
            assert 1 <= len(gen.response_ids) <= 12
            np.testing.assert_allclose(
                gen.response_logprobs,
                _reference_logprobs(engine.model, prompt, gen.response_ids, temperature),
                atol=1e-4,
            )


def test_generation_is_seeded(engine) -> None:
    prompts = [p for p, _ in _prompt_and_choices(engine, 3)]
    a = engine.generate(prompts, temperature=1.0, max_new_tokens=10, stop=(), seeds=[11, 12, 13])
    b = engine.generate(prompts, temperature=1.0, max_new_tokens=10, stop=(), seeds=[11, 12, 13])
    c = engine.generate(prompts, temperature=1.0, max_new_tokens=10, stop=(), seeds=[14, 15, 16])
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]
    # a row's continuation depends on its own seed only: alone, reordered, or among other rows
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], temperature=1.0, max_new_tokens=10, stop=(), seeds=[11 + i])[0]
        assert alone.response_ids == a[i].response_ids
        np.testing.assert_allclose(alone.response_logprobs, a[i].response_logprobs, atol=1e-5)
    flipped = engine.generate(prompts[::-1], temperature=1.0, max_new_tokens=10, stop=(), seeds=[13, 12, 11])
    assert [g.response_ids for g in flipped[::-1]] == [g.response_ids for g in a]
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(prompts, temperature=1.0, max_new_tokens=10, stop=(), seeds=[1])


def test_per_row_sampling_follows_the_sampling_distribution(engine) -> None:
    """First tokens of many rows (one seed each) of one prompt ~ softmax(logits / T): chi-square."""
    prompt = _prompt_and_choices(engine, 1)[0][0]
    temperature, rows = 0.2, 3000  # a peaked distribution: a sampler ignoring T would fail
    gens = engine.generate(
        [prompt] * rows, temperature=temperature, max_new_tokens=1, stop=(), seeds=range(100, 100 + rows)
    )
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    p = torch.softmax(logits.double() / temperature, -1).numpy()
    p = p / p.sum()
    counts = np.bincount([g.response_ids[0] for g in gens], minlength=p.size)
    # bins: tokens expected >= 5 times each, the rest pooled (chi-square needs non-tiny expectations)
    big = p * rows >= 5
    observed, expected = counts[big], p[big] * rows
    if not big.all():
        observed, expected = (
            np.append(observed, counts[~big].sum()),
            np.append(expected, p[~big].sum() * rows),
        )
    assert big.sum() >= 3
    result = chisquare(observed, expected)
    assert result.pvalue > 1e-3, (observed, expected)


def test_greedy_batch_equals_each_prompt_alone(engine) -> None:
    prompts = [p for p, _ in _prompt_and_choices(engine, 3)]
    prompts[0] = prompts[0][:9]
    batch = engine.generate(prompts, temperature=0.0, max_new_tokens=8, stop=(), seeds=[0, 1, 2])
    for prompt, gen in zip(prompts, batch, strict=True):
        alone = engine.generate([prompt], temperature=0.0, max_new_tokens=8, stop=(), seeds=[3])[0]
        assert alone.response_ids == gen.response_ids


def test_generation_stops_at_stop_strings_and_length(engine) -> None:
    prompts = [p for p, _ in _prompt_and_choices(engine, 4)]
    gens = engine.generate(prompts, temperature=1.0, max_new_tokens=30, stop=("o",), seeds=[2, 3, 4, 5])
    for gen in gens:
        if gen.finish_reason == "stop":
            assert "o" in gen.text
            assert "o" not in engine.tokenizer.decode(gen.response_ids[:-1], skip_special_tokens=True)
        elif gen.finish_reason == "length":
            assert len(gen.response_ids) == 30 and "o" not in gen.text
        else:
            assert gen.finish_reason == "eos" and gen.response_ids[-1] == engine.tokenizer.eos_token_id
    assert any(g.finish_reason == "stop" for g in gens)
