"""TextWorld games generated from seeds: generation into a cache, the walkthrough wins, cache reuse,
determinism, the episode rules and state keys. Skips without the ``textworld`` package."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.errors import GraftError
from stages.envs import textworld_env
from stages.envs.base import Episode
from stages.envs.registry import make_env

textworld = pytest.importorskip(
    "textworld", reason="the textworld package is not installed (pip install -e '.[envs]')"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("twcache")


@pytest.fixture(scope="module")
def env(cache):
    return make_env("textworld", cache_dir=str(cache), max_turns=20)


@pytest.fixture(scope="module")
def task(env):
    return env.tasks("train", 1, seed=0)[0]


@pytest.fixture(scope="module")
def game_file(env, task, cache) -> Path:
    """The task's game, generated into the module's empty cache by the first reset."""
    assert not list(cache.rglob("*.z8"))
    env.new_game().reset(task)
    files = list(cache.rglob("*.z8"))
    assert files == [textworld_env.game_path(cache, task.spec)]
    return files[0]


def walkthrough(game_file: Path) -> list[str]:
    """The walkthrough the package stored with the generated game (the reference)."""
    return list(textworld.Game.load(str(game_file.with_suffix(".json"))).walkthrough)


def expert_trace(env, task) -> tuple[Episode, list]:
    episode = Episode(env, task)
    records = []
    while not episode.done:
        action = episode.game.expert_action()
        assert action is not None
        records.append(episode.act(action))
    return episode, records


def test_generation_leaves_only_the_finished_game(game_file):
    siblings = sorted(p.name for p in game_file.parent.iterdir())
    assert siblings == sorted(game_file.with_suffix(s).name for s in (".json", ".ni", ".z8"))  # no temp dirs


def test_walkthrough_wins_with_outcome_ten(env, task, game_file):
    episode, records = expert_trace(env, task)
    assert [r.action for r in records] == walkthrough(game_file)
    assert episode.won and episode.outcome == env.success_outcome == 10.0
    assert records[-1].terminated and not records[-1].truncated
    assert all(r.valid and r.reward == 0.0 for r in records)
    assert episode.game.expert_action() is None


def test_second_environment_loads_the_cached_game(env, task, game_file, cache, monkeypatch):
    before = game_file.stat().st_mtime_ns

    def no_generation(*args, **kwargs):
        raise AssertionError("the game should come from the cache")

    monkeypatch.setattr(textworld_env, "generate_game", no_generation)
    again = make_env("textworld", cache_dir=str(cache))
    first = again.new_game().reset(again.tasks("train", 1, seed=0)[0])
    assert first == env.new_game().reset(task)
    assert game_file.stat().st_mtime_ns == before


def test_reset_observation(env, task, game_file):
    first = env.new_game().reset(task)
    assert "$$" not in first.text and not first.text.rstrip().endswith(">")  # banner and prompt removed
    assert "-= Bedroom =-" in first.text
    assert first.task_text and first.task_text in " ".join(first.text.split())
    assert first.admissible == sorted(first.admissible) and {"look", "inventory"} <= set(first.admissible)
    assert "loc: bedroom" in first.state_key and "inv: -" in first.state_key


def test_episode_rules_invalid_actions_and_truncation(cache, task, game_file):
    short = make_env("textworld", cache_dir=str(cache), max_turns=4)
    episode = Episode(short, task)
    start = episode.current
    bad = episode.act("dance with the wooden door")
    assert not bad.valid and bad.reward == -0.1 and bad.state == bad.next_state == start.state_key
    assert episode.act(None).reward == -0.1
    records = [episode.act("look"), episode.act("look")]
    assert records[-1].truncated and records[-1].done and not records[-1].terminated
    assert not episode.won and episode.outcome == 0.0


def test_state_key_tells_apart_states_with_the_same_text(env, task, game_file):
    game = env.new_game()
    game.reset(task)
    before = game.step("examine wooden door").observation
    game.step("open antique trunk")
    game.step("take old key from antique trunk")
    after = game.step("examine wooden door").observation
    assert before.text == after.text and before.state_key != after.state_key
    assert "inv: old key" in after.state_key


def test_generation_and_play_are_deterministic(env, task, game_file, tmp_path, capsys):
    other = make_env("textworld", cache_dir=str(tmp_path))
    twin = other.tasks("train", 1, seed=0)[0]
    assert twin == task and twin.spec == task.spec
    capsys.readouterr()
    first_a, first_b = env.new_game().reset(task), other.new_game().reset(twin)  # regenerates in tmp_path
    # a generation is announced (it takes seconds, minutes for a batch of games), a cache hit is not
    assert capsys.readouterr().err.count("textworld: generating") == 1
    assert first_a == first_b
    assert walkthrough(textworld_env.game_path(tmp_path, twin.spec)) == walkthrough(game_file)
    trace = [(r.observation, r.action, r.next_state) for r in expert_trace(env, task)[1]]
    assert trace == [(r.observation, r.action, r.next_state) for r in expert_trace(other, twin)[1]]


# -- task sets and options (no generation) -------------------------------------------------------


def test_task_sets_deterministic_and_splits_disjoint(tmp_path):
    env = make_env("textworld", cache_dir=str(tmp_path))
    train = env.tasks("train", 12, seed=1)
    assert train == env.tasks("train", 12, seed=1) and train != env.tasks("train", 12, seed=2)
    evals = env.tasks("eval", 12, seed=1)
    assert not {t.task_id for t in train} & {t.task_id for t in evals}
    assert {t.task_type for t in train} == {"tw-simple"}
    assert len({t.spec["game_seed"] for t in train}) == 12
    assert not list(tmp_path.iterdir())  # task sets generate nothing


def test_settings_are_checked(tmp_path):
    cooking = make_env("textworld", cache_dir=str(tmp_path), challenge="tw-cooking", settings={"go": 6})
    spec = cooking.tasks("train", 1, seed=0)[0].spec
    assert spec["settings"]["go"] == 6 and spec["settings"]["recipe"] == 1  # merged over the defaults
    with pytest.raises(GraftError, match="unknown tw-cooking setting 'spicy'"):
        make_env("textworld", challenge="tw-cooking", settings={"spicy": True})
    with pytest.raises(GraftError, match="challenge"):
        make_env("textworld", challenge="zork")
    with pytest.raises(GraftError, match="unknown option"):
        make_env("textworld", rooms=3)


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAFT_TEXTWORLD_CACHE", raising=False)
    assert make_env("textworld").cache_dir == Path("~/.cache/graft/textworld").expanduser()
    assert make_env("textworld", data=str(tmp_path)).cache_dir == tmp_path
    monkeypatch.setenv("GRAFT_TEXTWORLD_CACHE", str(tmp_path / "x"))
    assert make_env("textworld").cache_dir == tmp_path / "x"


def test_clean_feedback_drops_banner_and_prompt():
    raw = "\n\n   ____  __\n  |  $$ \\$$\n\nWelcome!\n\n\n\n-= Hall =-\nA hall.\n\n>   -= Hall =-0/1"
    assert textworld_env.clean_feedback(raw) == "Welcome!\n\n-= Hall =-\nA hall."
