"""The tiny tokenizer's vocabulary: how many tasks it plays (model.tiny_vocab_tasks), that the
default leaves no word of held-out tasks out, progress, and that a second build reuses generated
games."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from schemas.config import DEFAULT_TINY_VOCAB_TASKS, load_config
from schemas.errors import GraftError
from stages.envs.registry import make_env, make_environment
from stages.policy.tiny import build_tiny_model, environment_texts, vocab_tasks_for
from stages.policy.tokenizer import build_word_tokenizer, vocabulary_misses
from stages.warmstart.initial import build_tiny_for_config
from tests.helpers.paths import CONFIGS
from tests.helpers.vocab import tokenizer_vocab

HELD_OUT_SEED = 12345  # task sets the vocabulary never played (it uses VOCAB_SEED = 0)


def test_vocabulary_misses_are_the_words_without_a_token() -> None:
    tokenizer = build_word_tokenizer(["the cat sat"])
    assert vocabulary_misses(tokenizer, ["the cat sat"]) == set()
    assert vocabulary_misses(tokenizer, ["the dog sat"]) == {"Ġdog"}  # Ġ: the byte-level space
    assert vocabulary_misses(tokenizer, ["<action>the cat</action>"]) == set()  # tags are added tokens


@pytest.mark.parametrize("value", ["-1", '"many"', "1.5"])
def test_the_knob_is_validated(value: str) -> None:
    with pytest.raises(GraftError, match="model.tiny_vocab_tasks"):
        load_config(None, [f"model.tiny_vocab_tasks={value}"])


def test_zero_means_the_environments_own_number() -> None:
    household, shop, search = make_env("household"), make_env("shop"), make_env("search")
    assert load_config().model.tiny_vocab_tasks == 0
    assert vocab_tasks_for(household, 0) == household.vocab_tasks == 150
    assert vocab_tasks_for(shop, 0) == shop.vocab_tasks == 32
    assert vocab_tasks_for(search, 0) == DEFAULT_TINY_VOCAB_TASKS  # no vocab_tasks of its own
    assert vocab_tasks_for(search, 3) == 3
    with pytest.raises(GraftError, match=">= 0"):
        vocab_tasks_for(search, -2)


def test_the_model_plays_twice_the_knob_in_tasks_with_progress(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    build_tiny_model(
        tmp_path / "m",
        make_env("shop"),
        tasks_per_split=3,
        spec=_small(),
        on_task=lambda d, t: seen.append((d, t)),
    )
    assert seen == [(i, 6) for i in range(1, 7)]  # 3 train + 3 eval tasks, counted one by one


def test_the_config_knob_reaches_the_tokenizer(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "quickstart.toml", ["model.tiny_vocab_tasks=2", "model.tiny_hidden=16"])
    build_tiny_for_config(tmp_path / "m", config)
    env = make_environment(config)
    expected = build_word_tokenizer(list(dict.fromkeys(environment_texts(env, tasks_per_split=2))))
    assert tokenizer_vocab(tmp_path / "m") == expected.backend_tokenizer.get_vocab(with_added_tokens=False)


@pytest.mark.parametrize(
    ("config_file", "sets"),
    [("quickstart.toml", []), ("quickstart.toml", ["env.options={}"]), ("cpu/shop.toml", [])],
    ids=["quickstart", "household-default", "shop"],
)
def test_default_vocabulary_covers_held_out_tasks(config_file: str, sets: list[str]) -> None:
    config = load_config(CONFIGS / config_file, sets)
    env = make_environment(config)
    held_out = list(dict.fromkeys(environment_texts(env, tasks_per_split=16, seed=HELD_OUT_SEED)))
    full = build_word_tokenizer(
        list(dict.fromkeys(environment_texts(env, tasks_per_split=vocab_tasks_for(env))))
    )
    assert vocabulary_misses(full, held_out) == set()
    few = build_word_tokenizer(list(dict.fromkeys(environment_texts(env, tasks_per_split=1))))
    assert vocabulary_misses(few, held_out)  # the check can fail: one task misses words


def _small():
    from stages.policy.tiny import TinySpec

    return TinySpec(hidden=16, layers=1, heads=2)


@pytest.mark.slow
def test_a_second_textworld_build_reuses_the_generated_games(tmp_path: Path, monkeypatch) -> None:
    if importlib.util.find_spec("textworld") is None:
        pytest.skip("the textworld package is not installed (pip install -e '.[envs]')")
    from stages.envs import textworld_env

    generated: list[Path] = []
    real = textworld_env.generate_game

    def counting(spec, target):  # type: ignore[no-untyped-def]
        generated.append(target)
        return real(spec, target)

    monkeypatch.setattr(textworld_env, "generate_game", counting)
    env = make_env("textworld", cache_dir=str(tmp_path / "games"), max_turns=3)
    build_tiny_model(tmp_path / "a", env, tasks_per_split=1, spec=_small())
    first = len(generated)
    assert first == 2  # one train and one eval game
    env = make_env("textworld", cache_dir=str(tmp_path / "games"), max_turns=3)  # a new process's view
    build_tiny_model(tmp_path / "b", env, tasks_per_split=1, spec=_small())
    assert len(generated) == first  # nothing generated again
    assert tokenizer_vocab(tmp_path / "a") == tokenizer_vocab(tmp_path / "b")


def test_textworld_grammar_phrases_join_the_vocabulary() -> None:
    if importlib.util.find_spec("textworld") is None:
        pytest.skip("the textworld package is not installed (pip install -e '.[envs]')")
    from stages.envs.textworld_env import grammar_phrases

    phrases = grammar_phrases()
    # house_instruction.twg: "make_syn_u:Make sure;Assure;Make it so;Doublecheck;..." (symbols removed)
    assert {"Doublecheck", " Doublecheck", "Make it so", " make it so"} <= set(phrases)
    assert not any("#" in p for p in phrases)
    env = make_env("textworld", max_turns=3)
    texts = environment_texts(env, tasks_per_split=1)
    assert [next(texts) for _ in range(3)] == phrases[:3]  # offered before any game is played
    tokenizer = build_word_tokenizer(phrases)
    assert vocabulary_misses(tokenizer, ["Doublecheck it. Assure that, make it so"]) == set()
