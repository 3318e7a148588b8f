"""Update stage: trainer, checkpoints, runner, CLI (docs/design.md §7)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from schemas import write_table
from schemas.config import UpdateConfig
from schemas.errors import GraftError
from schemas.integrity import CHECKPOINT_MARKER, checkpoint_complete
from schemas.rundir import Run
from tests.helpers.tiny_qwen import tiny_qwen2
from tests.helpers.update_rows import (
    ACTIONS,
    TEXTS,
    make_run,
    make_tokenizer,
    reuse_rows,
    rows_for,
    update_values,
)

torch.set_num_threads(1)

# ---------------------------------------------------------------------------------------------
# helpers


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _train(model, rows, optimizer=None, **cfg):
    from stages.update.distributed import DistContext
    from stages.update.trainer import score_all_rows, train_policy

    ucfg = UpdateConfig(**{"lr": 1e-2, "minibatch_size": 8, "epochs": 1, "beta": 0.0, **cfg})
    ctx = DistContext()
    old = score_all_rows(model, rows, 1.0, ucfg.max_tokens_per_batch, ctx)
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=ucfg.lr, weight_decay=0.0)
    return train_policy(model, rows, old, None, ucfg, 1.0, np.random.default_rng(0), ctx, opt)


# ---------------------------------------------------------------------------------------------
# trainer behaviour


def test_first_step_ratio_is_one_when_old_is_recomputed(tmp_path):
    from stages.update import run_update

    for mode in ("choose", "generate"):
        run, config = make_run(tmp_path / mode, mode)
        run_update(run, 0, config)
        t = update_values(run)
        assert t[(0, 0, "ratio_mean")] == pytest.approx(1.0, abs=1e-6)
        assert t[(0, 0, "ratio_max")] == pytest.approx(1.0, abs=1e-6)
        assert t[(0, 0, "clip_fraction")] == 0.0
        assert t[(-1, -1, "old_logprobs_stored")] == 0.0
        assert t[(-1, -1, "rows")] == 12 and t[(-1, -1, "steps")] == 6  # 12 rows / 5 -> 3 steps x 2 epochs


@pytest.mark.parametrize("mode", ["choose", "generate"])
def test_old_logprobs_from_the_first_steps_forward_train_the_same_weights(tmp_path, mode):
    """update.old_logprobs = "forward": the first minibatch's old log-probs come from that step's own
    forward pass instead of a no-grad pass; the policy before step 1 is the old policy, so the update
    is the recomputing one's -- same steps, weights, reference cache -- with one pass fewer over them."""
    from schemas import read_table
    from stages.update import run_update

    results = {}
    for setting in ("recompute", "forward"):
        run, config = make_run(tmp_path / setting, mode, old_logprobs=setting)
        run_update(run, 0, config)
        reference = read_table(run.table_path(0, "reflogprobs"), "reflogprobs")
        results[setting] = (update_values(run), _weights(run.checkpoint_dir(0)), reference)
    (recomputed, w_recomputed, ref_recomputed), (forward, w_forward, ref_forward) = results.values()
    assert forward[(-1, -1, "old_logprobs_from_forward")] == 5  # the first minibatch: 5 of 12 rows
    assert recomputed[(-1, -1, "old_logprobs_from_forward")] == 0
    assert forward[(0, 0, "ratio_mean")] == 1.0 and forward[(0, 0, "ratio_max")] == 1.0  # exactly
    for key, value in recomputed.items():
        if key[2] not in (
            "seconds",
            "tokens_per_s",
            "old_seconds",
            "ref_seconds",
            "old_logprobs_from_forward",
        ):
            assert forward[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for name, tensor in w_recomputed.items():
        torch.testing.assert_close(w_forward[name], tensor, rtol=1e-4, atol=1e-6)
    # iteration 0 trains the reference: its cached log-probs are the same numbers either way
    for a, b in zip(
        ref_recomputed["ref_logprobs"].to_list(), ref_forward["ref_logprobs"].to_list(), strict=True
    ):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_stored_logprobs_are_used_for_the_training_engine(tmp_path):
    """engine hf + matching policy_version: old = stored, so w = exp(mean(logp - stored)) = exp(-0.1)."""
    from stages.update import run_update
    from stages.update.checkpoint import load_model
    from stages.update.logprobs import response_log_probs

    run, config = make_run(tmp_path, "generate")
    config.rollout.engine = "hf"
    steps = run.read(0, "steps")
    model = load_model(run.initial_model_dir)
    with torch.no_grad():
        logp, mask, _ = response_log_probs(
            model, steps["prompt_ids"].to_list(), steps["response_ids"].to_list()
        )
    stored = [(logp[i][mask[i]] + 0.1).tolist() for i in range(steps.height)]
    steps = steps.with_columns(pl.Series("response_logprobs", stored, dtype=pl.List(pl.Float32)))
    write_table(steps, "steps", run.table_path(0, "steps"))
    run_update(run, 0, config)
    t = update_values(run)
    assert t[(-1, -1, "old_logprobs_stored")] == 1.0
    assert t[(0, 0, "ratio_mean")] == pytest.approx(np.exp(-0.1), abs=1e-5)

    # rows acted by another policy version: recomputed, so the first ratio is 1 again
    write_table(
        steps.with_columns(pl.lit("iter_0007").alias("policy_version")), "steps", run.table_path(0, "steps")
    )
    run_update(run, 0, config)
    t = update_values(run)
    assert t[(-1, -1, "old_logprobs_stored")] == 0.0
    assert t[(0, 0, "ratio_mean")] == pytest.approx(1.0, abs=1e-6)


def test_stored_choice_scores_are_the_old_policy_of_choose_rows(tmp_path):
    """update.old_logprobs = "stored" in choose mode: pi_old(a|s) = log_softmax_j(m_j / T) of the rollout's
    choice_scores, no row recomputed. Scores equal to the trainer's give the recomputing update's first
    ratio (1); uniform scores give pi_old = 1/K, so the first ratio of row i is K_i * pi_theta(a_i|s_i)."""
    from stages.update import run_update
    from stages.update.checkpoint import load_model
    from stages.update.logprobs import choice_log_probs
    from stages.update.runner import effective_temperature

    run, config = make_run(
        tmp_path, "choose", old_logprobs="stored", minibatch_size=12, epochs=1, kl_probe_rows=12
    )
    config.rollout.engine = "vllm"  # another engine acted: the update reports its gap to the trainer
    steps = run.read(0, "steps")
    tok = make_tokenizer()
    choices = [[tok.encode(c, add_special_tokens=False) for c in cs] for cs in steps["choices"].to_list()]
    chosen = [
        cs.index(a) for cs, a in zip(steps["choices"].to_list(), steps["action"].to_list(), strict=True)
    ]
    temperature = effective_temperature(config)
    with torch.no_grad():
        scores = choice_log_probs(
            load_model(run.initial_model_dir), steps["prompt_ids"].to_list(), choices, temperature
        )
    pi_theta = np.array([float(scores.log_probs[i, j].exp()) for i, j in enumerate(chosen)])
    trainer_m = [scores.mean_logprob[i, : len(cs)].double().tolist() for i, cs in enumerate(choices)]
    uniform = [[0.0] * len(cs) for cs in choices]
    # the probe (all 12 rows) compares each stored distribution with the trainer's: 0, or |log(1/K) - log pi|
    uniform_gap = np.concatenate(
        [
            np.abs(-np.log(len(cs)) - scores.log_probs[i, : len(cs)].double().numpy())
            for i, cs in enumerate(choices)
        ]
    )
    for name, stored, expected, gap in (
        ("same", trainer_m, 1.0, (0.0, 0.0)),
        (
            "uniform",
            uniform,
            float(np.mean([len(cs) * p for cs, p in zip(choices, pi_theta, strict=True)])),
            (uniform_gap.max(), uniform_gap.mean()),
        ),
    ):
        table = steps.with_columns(pl.Series("choice_scores", stored, dtype=pl.List(pl.Float64)))
        write_table(table, "steps", run.table_path(0, "steps"))
        run_update(run, 0, config)
        t = update_values(run)
        assert t[(-1, -1, "old_logprobs_stored")] == 1.0 and t[(-1, -1, "old_logprobs_stored_rows")] == 12
        assert t[(0, 0, "ratio_mean")] == pytest.approx(expected, abs=1e-5), name
        assert t[(-1, -1, "engine_choice_gap_max")] == pytest.approx(gap[0], abs=1e-5), name
        assert t[(-1, -1, "engine_choice_gap_mean")] == pytest.approx(gap[1], abs=1e-5), name
        # no row was recomputed, so there is no token gap to report (rather than a gap of 0)
        assert (-1, -1, "engine_logprob_gap_max") not in t
    assert expected != pytest.approx(1.0, abs=1e-3)  # the uniform case is a real test of which pi_old is used

    # a choose row without choice_scores is refused by name, before anything is written
    write_table(steps, "steps", run.table_path(0, "steps"))
    run.table_path(0, "update").unlink()
    with pytest.raises(GraftError, match=r"old_logprobs = 'stored' but row 0 .* has no choice_scores"):
        run_update(run, 0, config)
    assert not run.table_path(0, "update").exists()


def test_choice_scores_must_match_the_choices():
    from stages.update.batching import build_update_rows

    tok = make_tokenizer()
    ids = tok.encode("go", add_special_tokens=False)
    row = {
        "group_id": "g",
        "traj_id": "t",
        "step": 0,
        "prompt_ids": [1, 2],
        "response_ids": ids,
        "choices": ["go", "look"],
        "advantage": 1.0,
    }
    encode = lambda cs: [tok.encode(c, add_special_tokens=False) for c in cs]  # noqa: E731
    for bad in ([-1.0], [-1.0, float("nan")]):
        joined = pl.DataFrame([{**row, "choice_scores": bad}])
        with pytest.raises(GraftError, match="row 0 .*choice_scores must be one finite number per choice"):
            build_update_rows(joined, encode)
    rows = build_update_rows(pl.DataFrame([{**row, "choice_scores": [-1.0, -2.0]}]), encode)
    np.testing.assert_array_equal(rows.choice_scores[0], [-1.0, -2.0])


def test_a_step_raises_positive_and_lowers_negative_responses():
    from stages.update.logprobs import choice_log_probs, response_log_probs

    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7], [5, 6, 7]]
    responses = [[10, 11], [12, 13, 14], [20], [21, 22]]
    adv = [1.0, -1.0, -1.0, 1.0]
    model = tiny_qwen2()
    with torch.no_grad():
        before = response_log_probs(model, prompts, responses)[0].sum(-1)
    _train(model, rows_for(prompts, responses, adv))
    with torch.no_grad():
        after = response_log_probs(model, prompts, responses)[0].sum(-1)
    assert torch.all(torch.sign(after - before) == torch.tensor(adv).sign())

    # choose mode: pi(a|s) over the choices moves the same way
    choices = [[[10, 11], [12, 13, 14]], [[10, 11], [12, 13, 14]], [[20], [21, 22]], [[20], [21, 22]]]
    model = tiny_qwen2()
    with torch.no_grad():
        before = choice_log_probs(model, prompts, choices).log_probs
    _train(model, rows_for(prompts, responses, adv, choices))
    with torch.no_grad():
        after = choice_log_probs(model, prompts, choices).log_probs
    assert after[0, 0] > before[0, 0] and after[1, 1] < before[1, 1]
    assert after[2, 0] < before[2, 0] and after[3, 1] > before[3, 1]


def test_zero_advantage_rows_give_no_gradient():
    model = tiny_qwen2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = rows_for([[1, 2, 3], [4, 5]], [[6, 7], [8]], [0.0, 0.0], choices=None)
    result = _train(model, rows)
    assert all(m["grad_norm"] == 0.0 for _, _, m in result.steps)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _sgd_delta(objective, responses):
    model = tiny_qwen2()
    before = [p.detach().clone() for p in model.parameters()]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    rows = rows_for(prompts, responses, [1.0, -0.5, 0.25])
    _train(
        model, rows, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), objective=objective, grad_clip=0.0
    )
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])


def test_token_objective_equals_grpo_c_only_when_lengths_are_equal():
    """At w = 1: GRPO-C grad = -(1/R) sum_i A_i/|o_i| sum_t grad logp, GRPO = -(1/T) sum_i A_i sum_t grad logp."""
    equal = [[10, 11], [12, 13], [14, 15]]
    assert torch.allclose(_sgd_delta("grpo_c", equal), _sgd_delta("grpo", equal), atol=1e-7)
    ragged = [[10], [12, 13, 14, 15], [16, 17]]
    assert not torch.allclose(_sgd_delta("grpo_c", ragged), _sgd_delta("grpo", ragged), atol=1e-5)


def test_choose_ratio_equals_probability_ratio_over_choices():
    """w = pi_theta(a|s) / pi_old(a|s) with pi = softmax(mean token log-prob / T) (naive reference)."""
    from stages.update.batching import MicroBatch
    from stages.update.distributed import DistContext
    from stages.update.loss import objective
    from stages.update.trainer import _terms, score_all_rows, score_microbatch

    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    choices = [[[10, 11], [12], [13, 14, 15]], [[20], [21, 22]]]
    responses = [[12], [21, 22]]
    rows = rows_for(prompts, responses, [1.0, -1.0], choices)
    t = 0.6
    old_model, new_model = tiny_qwen2(0), tiny_qwen2(1)
    old = score_all_rows(old_model, rows, t, 4096, DistContext())
    with torch.no_grad():
        s = score_microbatch(new_model, rows, MicroBatch(np.arange(2), True), t)
        terms = _terms(
            objective("grpo_c"),
            s,
            rows,
            MicroBatch(np.arange(2), True),
            old,
            None,
            UpdateConfig(beta=0.0),
            torch.device("cpu"),
        )

    def naive_pi(model, p, cs, chosen):
        means = []
        for c in cs:
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([p + c])).logits[0].double(), -1)
            means.append(sum(float(lp[len(p) - 1 + k, c[k]]) for k in range(len(c))) / len(c))
        z = np.exp(np.array(means) / t)
        return z[chosen] / z.sum()

    for b, chosen in enumerate((1, 1)):
        want = naive_pi(new_model, prompts[b], choices[b], chosen) / naive_pi(
            old_model, prompts[b], choices[b], chosen
        )
        assert float(terms.ratio[b]) == pytest.approx(want, rel=1e-5)


def test_microbatch_split_does_not_change_the_update(tmp_path):
    from stages.update import run_update

    runs = []
    for name, budget in (("one", 100_000), ("many", 40)):
        run, config = make_run(tmp_path / name, "mixed", max_tokens_per_batch=budget)
        run_update(run, 0, config)
        runs.append(_weights(run.checkpoint_dir(0)))
    for k in runs[0]:
        torch.testing.assert_close(runs[0][k], runs[1][k], atol=2e-5, rtol=1e-4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 1000))
def test_pack_microbatches_respects_the_token_budget(lengths, budget):
    from stages.update.batching import pack_microbatches

    lengths = np.asarray(lengths)
    is_choice = np.arange(len(lengths)) % 3 == 0
    batches = pack_microbatches(np.arange(len(lengths)), lengths, is_choice, budget)
    seen = np.concatenate([b.rows for b in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b.rows) == 1 or len(b.rows) * lengths[b.rows].max() <= budget
        assert np.all(is_choice[b.rows] == b.choice)


def _all_splits(n: int):
    """Every split of range(n) into consecutive non-empty chunks, as lists of chunk starts + [n]."""
    for mask in range(2 ** max(n - 1, 0)):
        yield [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=9), st.integers(1, 300), st.integers(0, 100))
def test_split_sorted_is_the_cheapest_split_within_the_budget(lengths, budget, overhead):
    """Brute force over all splits: same minimal cost (padded tokens + overhead per chunk), and the
    returned split is one of the allowed ones."""
    from stages.update.batching import split_sorted

    desc = np.sort(np.asarray(lengths))[::-1]

    def allowed(starts):
        return all(
            b - a == 1 or (b - a) * desc[a] <= budget for a, b in zip(starts[:-1], starts[1:], strict=True)
        )

    def cost(starts):
        return sum((b - a) * desc[a] + overhead for a, b in zip(starts[:-1], starts[1:], strict=True))

    got = split_sorted(desc, budget, overhead)
    assert allowed(got)
    assert cost(got) == min(cost(s) for s in _all_splits(desc.size) if allowed(s))


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_checkpoint_round_trip_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from stages.update.checkpoint import load_model, save_checkpoint

    model = tiny_qwen2(3)
    final = tmp_path / "checkpoints" / "iter_0000"
    save_checkpoint(final, model, make_tokenizer(), {"iteration": 0})
    assert checkpoint_complete(final)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(load_model(final)(ids).logits, want)
        assert torch.equal(AutoModelForCausalLM.from_pretrained(final).eval()(ids).logits, want)


def test_checkpoint_marker_is_written_last_and_a_crash_leaves_nothing(tmp_path, monkeypatch):
    import stages.update.checkpoint as ckpt

    final = tmp_path / "checkpoints" / "iter_0001"
    real_write = ckpt.atomic_write_text
    seen = []

    def spy(path, text):
        if path.name == CHECKPOINT_MARKER:
            seen.append(sorted(p.name for p in path.parent.iterdir()))
            assert not final.exists()
        real_write(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", spy)
    ckpt.save_checkpoint(final, tiny_qwen2(), make_tokenizer(), {"iteration": 1})
    assert "model.safetensors" in seen[0] and "tokenizer.json" in seen[0] and "config.json" in seen[0]
    monkeypatch.setattr(ckpt, "atomic_write_text", real_write)

    crashed = tmp_path / "checkpoints" / "iter_0002"

    def boom(tmp, dest):
        raise RuntimeError("killed before commit")

    import schemas.atomic

    monkeypatch.setattr(schemas.atomic, "commit_dir", boom)  # filled_dir commits through it
    with pytest.raises(RuntimeError):
        ckpt.save_checkpoint(crashed, tiny_qwen2(), None, {"iteration": 2})
    assert not crashed.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_0001"]
    assert Run(tmp_path).latest_checkpoint() == final


# ---------------------------------------------------------------------------------------------
# runner


def test_resumed_update_reuses_reference_logprobs_and_repeats_exactly(tmp_path, monkeypatch):
    import shutil

    import stages.update.runner as runner

    run, config = make_run(tmp_path, "mixed")
    runner.run_update(run, 0, config)
    first_weights = _weights(run.checkpoint_dir(0))
    first_table = update_values(run)
    assert run.table_path(0, "reflogprobs").is_file()
    assert run.stage_complete("update", 0)

    shutil.rmtree(run.checkpoint_dir(0))
    run.table_path(0, "update").unlink()

    def no_reference(*args, **kwargs):
        raise AssertionError("reference log-probs recomputed on resume")

    monkeypatch.setattr(runner, "compute_reference", no_reference)
    runner.run_update(run, 0, config)
    again = _weights(run.checkpoint_dir(0))
    for k in first_weights:
        assert torch.equal(first_weights[k], again[k]), k
    timing = {"seconds", "tokens_per_s", "ref_seconds", "old_seconds"}
    for key, value in update_values(run).items():
        if key[2] not in timing:
            assert value == first_table[key], key


def test_next_iteration_trains_the_previous_checkpoint_and_keeps_optimizer_state(tmp_path):
    from stages.update import run_update

    run, config = make_run(tmp_path, "choose")
    run_update(run, 0, config)
    reuse_rows(run, 1)
    run_update(run, 1, config)
    marker = json.loads((run.checkpoint_dir(1) / CHECKPOINT_MARKER).read_text())
    assert marker["trained_from"] == str(run.checkpoint_dir(0))
    assert marker["global_step"] == 12  # 6 optimizer steps per iteration, counted across the run
    w0, w1 = _weights(run.checkpoint_dir(0)), _weights(run.checkpoint_dir(1))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)


def test_warmup_is_linear_over_the_first_steps(tmp_path):
    from stages.update import run_update

    run, config = make_run(tmp_path, "choose", warmup_steps=4)
    run_update(run, 0, config)
    t = update_values(run)
    lrs = [t[(e, m, "lr")] for e in (0, 1) for m in (0, 1, 2)]
    assert lrs == pytest.approx([3e-3 * k / 4 for k in (1, 2, 3)] + [3e-3] * 3)


def test_bad_inputs_are_one_line_errors(tmp_path):
    from graft_cli.app import app
    from stages.update import run_update

    run, config = make_run(tmp_path, "generate")
    steps = run.read(0, "steps")
    broken = steps.with_columns(
        pl.when(pl.int_range(pl.len()) == 3)
        .then(None)
        .otherwise(pl.col("response_ids"))
        .alias("response_ids")
    )
    write_table(broken, "steps", run.table_path(0, "steps"))
    with pytest.raises(GraftError, match=r"row 3 \(traj_id='g0-t1', step=0\) has no response_ids"):
        run_update(run, 0, config)

    write_table(steps, "steps", run.table_path(0, "steps"))
    adv = run.read(0, "advantages")
    write_table(adv.reverse(), "advantages", run.table_path(0, "advantages"))
    result = CliRunner().invoke(app, ["update", str(run.root), "--iter", "0"])
    assert result.exit_code == 2
    assert "advantages must follow the steps row order" in result.output
    assert "Traceback" not in result.output


def test_cli_update_writes_checkpoint_and_table(tmp_path):
    from graft_cli.app import app

    run, _ = make_run(tmp_path, "choose")
    result = CliRunner().invoke(app, ["update", str(run.root), "--iter", "0", "--set", "update.epochs=1"])
    assert result.exit_code == 0, result.output
    assert "update iter 0:" in result.output
    assert run.stage_complete("update", 0)
    assert update_values(run)[(-1, -1, "steps")] == 3


@pytest.mark.parametrize("lr", [float("inf"), 1e38])
def test_an_absurd_lr_stops_with_an_error_and_writes_no_checkpoint(tmp_path, lr):
    """UpdateConfig built directly skips the config checks: the trainer itself refuses NaN weights."""
    from stages.update import run_update

    run, config = make_run(tmp_path, "choose", lr=lr)
    with pytest.raises(
        GraftError, match=r"update: (non-finite loss|the weights became non-finite|optimizer step overflowed)"
    ):
        run_update(run, 0, config)
    assert not run.checkpoint_dir(0).exists() and not run.stage_complete("update", 0)


def test_a_non_finite_loss_stops_before_the_optimizer_step(tmp_path):
    """Advantages of 1e300 overflow float32: the loss is -inf, so no step is taken and nothing written."""
    from graft_cli.app import app

    run, _ = make_run(tmp_path, "generate", epochs=1)
    adv = run.read(0, "advantages").with_columns(pl.lit(1e300).alias("advantage"))
    write_table(adv, "advantages", run.table_path(0, "advantages"))
    result = CliRunner().invoke(app, ["update", str(run.root), "--iter", "0"])
    assert result.exit_code == 2, result.output
    assert (
        "non-finite loss (-inf) or gradient norm (nan)" in result.stderr
        and "epoch 0, minibatch 0" in result.stderr
    )
    assert "Traceback" not in result.output
    assert not run.checkpoint_dir(0).exists()


def test_check_finite_step_passes_finite_values():
    from stages.update.trainer import check_finite_step

    check_finite_step(0, 0, 1.5, 0.0)
    for loss, norm in ((math.nan, 1.0), (1.0, math.inf), (-math.inf, 0.0)):
        with pytest.raises(GraftError, match="non-finite"):
            check_finite_step(1, 2, loss, norm)


# ---------------------------------------------------------------------------------------------
# work the update no longer repeats: equal results


def test_pruned_last_layer_gives_the_same_update(tmp_path, monkeypatch):
    """The last decoder layer run at the scored positions only (stages/update/last_layer.py) leaves the
    losses of every step equal to 1e-6 and the trained weights equal to float rounding."""
    from stages.update import logprobs, run_update

    tables, weights = {}, {}
    for prune in (False, True):
        monkeypatch.setattr(logprobs.SelectedLogits, "prune_last_layer", prune)
        run, config = make_run(tmp_path / str(prune), "mixed")
        run_update(run, 0, config)
        tables[prune], weights[prune] = update_values(run), _weights(run.checkpoint_dir(0))
    losses = [k for k in tables[False] if k[2] in ("loss", "policy_loss", "kl") and k[0] >= 0]
    assert len(losses) == 18  # 6 steps x 3
    for key in losses:
        assert tables[True][key] == pytest.approx(tables[False][key], abs=1e-6), key
    for k in weights[False]:
        torch.testing.assert_close(weights[True][k], weights[False][k], atol=1e-5, rtol=1e-5)


def test_update_job_computes_the_reference_once_and_holds_what_the_steps_derived(tmp_path, monkeypatch):
    """``prepare_update_job`` verifies the reference once (the whole update then reads the job's) and
    holds what the update's steps derived each for itself before: the steps table and its path, the
    acting policy, its tokenizer's rows, the effective temperature, iteration 0's policy as the
    reference; iteration 1 trains the checkpoint of iteration 0, not the reference."""
    import stages.update.runner as runner
    from schemas.initial_model import acting_policy
    from stages.update.batching import build_update_rows, join_steps_advantages
    from stages.update.distributed import DistContext

    run, config = make_run(tmp_path, "mixed")
    config.rollout.temperature = 0.0  # greedy rollouts: the ratios use T = 1
    real = runner.verified_initial_policy
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "verified_initial_policy", counted)
    ctx = DistContext()
    job = runner.prepare_update_job(run, 0, config, ctx)
    assert calls == [1]
    assert (job.run, job.iteration, job.config, job.ctx) == (run, 0, config, ctx)
    assert job.steps_path == run.table_path(0, "steps")
    assert job.steps.equals(run.read(0, "steps"))
    assert job.policy_path == acting_policy(run, 0, config, "update")[0] == run.initial_model_dir
    assert job.reference_path == real(run, config) == run.initial_model_dir
    assert job.is_reference and runner.policy_version(job) == job.version == "initial"
    assert job.temperature == runner.effective_temperature(config) == 1.0
    tok = make_tokenizer()
    rows = build_update_rows(
        join_steps_advantages(run.read(0, "steps"), run.read(0, "advantages")),
        lambda texts: [tok.encode(t, add_special_tokens=False) for t in texts],
    )
    assert job.rows.keys.equals(rows.keys)
    for name in ("prompt_ids", "response_ids"):
        for got, want in zip(getattr(job.rows, name), getattr(rows, name), strict=True):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(job.rows.advantage, rows.advantage)
    np.testing.assert_array_equal(job.rows.chosen, rows.chosen)
    with pytest.raises(AttributeError):
        job.iteration = 1  # type: ignore[misc]

    calls.clear()
    runner.run_update(run, 0, config)
    assert calls == [1]  # one update, one verification of the reference
    marker = json.loads((run.checkpoint_dir(0) / CHECKPOINT_MARKER).read_text())
    assert marker["reference"] == str(run.initial_model_dir)

    reuse_rows(run, 1)
    later = runner.prepare_update_job(run, 1, config, ctx)
    assert later.policy_path == run.checkpoint_dir(0) and later.reference_path == run.initial_model_dir
    assert not later.is_reference and runner.policy_version(later) == "iter_0000"


def test_iteration_zero_takes_the_reference_from_the_old_pass(tmp_path, monkeypatch):
    """In iteration 0 the trained policy is the reference: no second pass, and the cached reference
    log-probs equal a reference pass to 1e-6. Later iterations run the reference pass."""
    import stages.update.runner as runner
    from stages.update.batching import build_update_rows, join_steps_advantages
    from stages.update.distributed import DistContext

    run, config = make_run(tmp_path, "mixed")
    real = runner.compute_reference
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "compute_reference", counted)
    runner.run_update(run, 0, config)
    assert calls == []
    cached = run.read(0, "reflogprobs")["ref_logprobs"].to_list()
    tok = make_tokenizer()
    rows = build_update_rows(
        join_steps_advantages(run.read(0, "steps"), run.read(0, "advantages")),
        lambda texts: [tok.encode(t, add_special_tokens=False) for t in texts],
    )
    expected = real(run.initial_model_dir, rows, config, DistContext(), 1.0)
    assert len(cached) == rows.n
    for got, want in zip(cached, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=0)

    reuse_rows(run, 1)
    runner.run_update(run, 1, config)
    assert calls == [1]


def test_no_grad_passes_score_identical_rows_once(monkeypatch):
    """Repeated (prompt, response[, choices]) rows are scored once and get the same log-probs as when
    every row is scored (to 1e-6); rows that differ only in their choices are not merged."""
    import stages.update.trainer as trainer
    from stages.update.distributed import DistContext

    model = tiny_qwen2(seed=3)
    p1, p2 = [5, 6, 7, 8, 9], [10, 11, 12]
    r1, r2 = [20, 21], [22]
    c_a, c_b = [[20, 21], [22], [23, 24]], [[20, 21], [25]]
    prompts = [p1, p2, p1, p1, p2, p1]
    responses = [r1, r2, r1, r1, r2, r1]
    choices = [c_a, [[22], [26]], c_a, c_b, [[22], [26]], c_a]
    rows = rows_for(prompts, responses, np.zeros(6), choices)
    scored: list[int] = []
    real_score = trainer.score_microbatch

    def counting(model, rows, mb, *args, **kwargs):
        scored.extend(mb.rows.tolist())
        return real_score(model, rows, mb, *args, **kwargs)

    monkeypatch.setattr(trainer, "score_microbatch", counting)
    ctx = DistContext()
    got = trainer.score_all_rows(model, rows, 0.8, 4096, ctx)
    assert sorted(scored) == [0, 1, 3]  # rows 2, 5 repeat row 0; row 4 repeats row 1; row 3: other choices
    scored.clear()
    got_tokens = trainer.score_all_rows(model, rows, 0.8, 4096, ctx, as_tokens=True)
    assert sorted(scored) == [0, 1]  # the reference pass reads prompt + response only

    monkeypatch.setattr(trainer, "distinct_rows", lambda rows, indices, as_tokens: (indices, {}))
    every = trainer.score_all_rows(model, rows, 0.8, 4096, ctx)
    every_tokens = trainer.score_all_rows(model, rows, 0.8, 4096, ctx, as_tokens=True)
    np.testing.assert_allclose(got.choice, every.choice, atol=1e-6, rtol=0)
    for a, b in zip(got.tokens + got_tokens.tokens, every.tokens + every_tokens.tokens, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert got.choice[3] != pytest.approx(got.choice[0])  # same response, other choices: other pi(a|s)


def test_tied_embeddings_are_saved_once_and_reload_the_same(tmp_path):
    # an update checkpoint listed lm_head.weight beside model.embed_tokens.weight
    # (27 tensors for the tiny model's 26)
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from stages.policy.tiny import TinySpec, random_qwen2
    from stages.update.checkpoint import gather_model_state, save_checkpoint

    model = random_qwen2(
        make_tokenizer(), spec=TinySpec(hidden=32, layers=1, heads=2, max_positions=512), seed=0
    )
    assert model.config.tie_word_embeddings
    state = gather_model_state(model)
    assert "lm_head.weight" in state
    final = tmp_path / "ckpt"
    save_checkpoint(final, model, make_tokenizer(), {"iteration": 0}, model_state=state)
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    plain = tmp_path / "plain"
    model.save_pretrained(plain, safe_serialization=True)
    with safe_open(str(plain / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(final).eval()(ids).logits, model(ids).logits
        )


def test_saved_tokenizers_name_a_class_every_supported_transformers_has(tmp_path):
    # checkpoints carried tokenizer_class "TokenizersBackend" (transformers 5 only)
    import json

    from transformers import AutoTokenizer

    from stages.update.checkpoint import save_checkpoint

    final = tmp_path / "ckpt"
    tok = make_tokenizer()
    save_checkpoint(final, tiny_qwen2(3), tok, {"iteration": 0})
    config = json.loads((final / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not isinstance(config.get("extra_special_tokens"), list)
    reloaded = AutoTokenizer.from_pretrained(final)
    for text in TEXTS:
        assert reloaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert reloaded.eos_token == tok.eos_token and reloaded.pad_token == tok.pad_token
    assert checkpoint_complete(final)


def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes_the_layers():
    # no gradient checkpointing; the update keeps eval mode, which Hugging Face's
    # checkpointing would skip
    import copy

    from stages.policy.tiny import TinySpec, random_qwen2
    from stages.update.checkpoint import enable_gradient_checkpointing
    from stages.update.last_layer import supports_last_layer_pruning
    from stages.update.logprobs import response_log_probs

    tok = make_tokenizer()
    base = random_qwen2(tok, spec=TinySpec(hidden=32, layers=2, heads=2, max_positions=512), seed=5).eval()
    prompts = [tok.encode(TEXTS[0], add_special_tokens=False)] * 2
    responses = [tok.encode(a, add_special_tokens=False) for a in ACTIONS[:2]]

    def grads(model):
        logp, mask, _ = response_log_probs(model, prompts, responses)
        (logp * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(copy.deepcopy(base))
    checkpointed = copy.deepcopy(base)
    layers = enable_gradient_checkpointing(checkpointed)
    assert layers == len(checkpointed.model.layers)
    supports_last_layer_pruning(checkpointed)  # its once-per-model check runs forwards of its own
    calls = []
    first = checkpointed.model.layers[0]
    hook = first.self_attn.register_forward_hook(lambda *_: calls.append(1))
    got = grads(checkpointed)
    hook.remove()
    assert len(calls) == 2  # the forward, then its recomputation in the backward
    assert not first.self_attn.training and not first.mlp.training  # no dropout switched on
    assert got.keys() == plain.keys()
    for name, g in plain.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_the_update_runs_with_gradient_checkpointing(tmp_path):
    from stages.update import run_update

    weights = []
    for flag in (False, True):
        run, config = make_run(tmp_path / str(flag), "generate", gradient_checkpointing=flag)
        run_update(run, 0, config)
        weights.append(_weights(run.checkpoint_dir(0)))
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_master_weights_train_and_save_in_bf16(tmp_path):
    # fp32 master weights + AdamW only
    from safetensors import safe_open

    from stages.update import run_update

    run, config = make_run(tmp_path, "generate", master_dtype="bfloat16", lr=1e-2)
    run_update(run, 0, config)
    with safe_open(str(run.checkpoint_dir(0) / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert dtypes == {torch.bfloat16}
    table = update_values(run)
    assert math.isfinite(table[(-1, -1, "loss")]) and table[(-1, -1, "policy_kl")] > 0
    initial = _weights(run.initial_model_dir)
    trained = _weights(run.checkpoint_dir(0))
    moved = [n for n in initial if not torch.equal(initial[n].to(torch.bfloat16), trained[n])]
    assert moved  # the bf16 weights did change
