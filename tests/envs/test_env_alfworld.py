"""The real ALFWorld environment on the 24 games in ../shared/data/alfworld (or $ALFWORLD_DATA).

Tests that play games need the ``alfworld`` package and the data; elsewhere they skip with the reason.
Engines are slow to load (0.2–5 s per game), so the environment is shared per module and the games
are the cheap ones of each type.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest

from schemas.errors import GraftError
from stages.envs.base import Episode, Task
from stages.envs.registry import make_env
from tests.helpers.alfworld import DATA, needs_alfworld

# two games per type where the package's handcoded expert wins (it wins all 22 solvable games here);
# the number is the expert's episode length, measured once, which the test checks exactly
EXPERT_WINS = {
    "look_at_obj_in_light-Bowl-None-DeskLamp-316": 11,
    "look_at_obj_in_light-AlarmClock-None-DeskLamp-323": 5,
    "pick_and_place_simple-Book-None-Sofa-229": 8,
    "pick_and_place_simple-Box-None-Dresser-224": 5,
    "pick_clean_then_place_in_recep-ButterKnife-None-CounterTop-8": 30,
    "pick_clean_then_place_in_recep-ButterKnife-None-Drawer-2": 40,
    "pick_cool_then_place_in_recep-Apple-None-CounterTop-14": 10,
    "pick_cool_then_place_in_recep-Apple-None-GarbageCan-2": 16,
    "pick_heat_then_place_in_recep-Apple-None-DiningTable-26": 16,
    "pick_heat_then_place_in_recep-Egg-None-CounterTop-2": 16,
    "pick_two_obj_and_place-AlarmClock-None-Dresser-305": 12,
    "pick_two_obj_and_place-Box-None-CoffeeTable-213": 14,
}
LOOK_GAME = "look_at_obj_in_light-AlarmClock-None-DeskLamp-323"


@pytest.fixture(scope="module")
def env():
    needs_alfworld()
    return make_env("alfworld", data=str(DATA))


def task_of(env, folder: str) -> Task:
    """The task of the game in task folder ``folder`` (drawn from a task set that holds every game)."""
    pool = env.tasks("eval", len(env.games("eval")), seed=0)
    return next(t for t in pool if t.task_id.split("/")[2] == folder)


def play_expert(env, task: Task) -> tuple[Episode, list]:
    episode = Episode(env, task)
    records = []
    while not episode.done:
        action = episode.game.expert_action()
        assert action is not None, f"expert gave up after {episode.turn} turns"
        records.append(episode.act(action))
    return episode, records


# -- configuration errors (no package needed) ----------------------------------------------------


def test_missing_data_root_says_how_to_set_it(monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(GraftError, match="ALFWORLD_DATA"):
        make_env("alfworld")


def test_data_root_without_games_is_rejected(tmp_path):
    with pytest.raises(GraftError, match=r"json_2\.1\.1"):
        make_env("alfworld", data=str(tmp_path))


def test_unknown_option_and_task_type_are_rejected():
    with pytest.raises(GraftError, match="unknown option 'colour'"):
        make_env("alfworld", data=str(DATA), colour="red")
    with pytest.raises(GraftError, match="task_types"):
        make_env("alfworld", data=str(DATA), task_types=["pick_and_place_simple", "juggle"])


# -- task sets -----------------------------------------------------------------------------------


@pytest.mark.alfworld
def test_task_pool_is_the_solvable_games_with_their_types(env):
    on_disk = sorted((DATA / "json_2.1.1").glob("*/*/*/game.tw-pddl"))
    solvable = {p.parent.parent.name for p in on_disk if json.loads(p.read_text()).get("solvable")}
    pool = env.games("eval")
    assert {g.task_id.split("/")[1] for g in pool} == solvable
    assert len(pool) == len(solvable) < len(on_disk)  # the unsolvable games are left out
    for game in pool:
        traj = json.loads((game.game_file.parent / "traj_data.json").read_text())
        assert game.task_type == traj["task_type"]


@pytest.mark.alfworld
def test_task_sets_are_deterministic_seeded_and_cycle(env):
    n = len(env.games("eval"))
    a = env.tasks("eval", 8, seed=3)
    assert [t.task_id for t in a] == [t.task_id for t in env.tasks("eval", 8, seed=3)]
    assert [t.task_id for t in a] != [t.task_id for t in env.tasks("eval", 8, seed=4)]
    assert len({t.task_id for t in a}) == 8
    full = env.tasks("eval", n + 3, seed=3)
    assert len({t.task_id for t in full[:n]}) == n  # every game once, then the order repeats
    assert [t.task_id for t in full[n:]] == [t.task_id for t in full[:3]]
    # only valid_seen exists here: "train" draws from the same games, in its own order
    train = env.tasks("train", n, seed=3)
    assert {t.task_id for t in train} == {t.task_id for t in full[:n]}
    assert [t.task_id for t in train] != [t.task_id for t in full[:n]]
    with pytest.raises(GraftError, match="split"):
        env.tasks("test", 1, seed=0)


@pytest.mark.alfworld
def test_task_types_option_filters_the_pool():
    needs_alfworld()
    only = make_env("alfworld", data=str(DATA), task_types=["pick_two_obj_and_place"])
    tasks = only.tasks("eval", 4, seed=0)
    assert {t.task_type for t in tasks} == {"pick_two_obj_and_place"}


# -- playing -------------------------------------------------------------------------------------


@pytest.mark.alfworld
@pytest.mark.parametrize(
    "folder",
    [
        pytest.param(f, marks=pytest.mark.slow) if f.startswith("pick_clean") else f  # ~10 s each
        for f in sorted(EXPERT_WINS)
    ],
)
def test_handcoded_expert_wins(env, folder):
    task = task_of(env, folder)
    episode, records = play_expert(env, task)
    assert episode.won and episode.outcome == env.success_outcome == 10.0
    assert len(records) == EXPERT_WINS[folder] <= env.max_turns
    assert all(r.valid and r.reward == 0.0 and r.error is None for r in records)
    assert records[-1].terminated and not records[-1].truncated
    assert not any(r.done for r in records[:-1])
    assert episode.game.expert_action() is None  # nothing left to do


@pytest.mark.alfworld
def test_reset_and_step_contract(env):
    game = env.new_game()
    first = game.reset(task_of(env, LOOK_GAME))
    assert first.text.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert first.text.endswith("Your task is to: look at alarmclock under the desklamp.")
    assert first.task_text == "look at alarmclock under the desklamp"
    assert first.admissible == sorted(set(first.admissible))
    assert {"look", "inventory", "go to sidetable 1"} <= set(first.admissible)
    assert game.expert_action() == "look"  # the package's expert always starts by looking
    result = game.step("go to sidetable 1")
    assert result.observation.text.startswith(
        "You arrive at loc 2. On the sidetable 1, you see a alarmclock 3"
    )
    assert (result.reward, result.terminated, result.won, result.outcome) == (0.0, False, False, 0.0)
    assert "take alarmclock 3 from sidetable 1" in result.observation.admissible
    assert result.observation.task_text == first.task_text


@pytest.mark.alfworld
def test_invalid_action_costs_the_penalty_and_does_not_advance(env):
    episode = Episode(env, task_of(env, LOOK_GAME))
    start = episode.current
    for action in ("fly to the moon", None, "take alarmclock 3 from sidetable 1"):  # the last: not here yet
        record = episode.act(action)
        assert not record.valid and record.reward == env.invalid_penalty == -0.1
        assert record.state == record.next_state == start.state_key
        assert episode.current is start and not record.done
    moved = episode.act("go to sidetable 1")
    assert moved.valid and moved.next_state != start.state_key and episode.turn == 4


@pytest.mark.alfworld
def test_turn_limit_truncates_with_outcome_zero():
    needs_alfworld()
    short = make_env("alfworld", data=str(DATA), max_turns=5)
    episode = Episode(short, task_of(short, LOOK_GAME))
    records = [episode.act("look") for _ in range(5)]
    assert [r.done for r in records] == [False] * 4 + [True]
    assert records[-1].truncated and not records[-1].terminated
    assert all(r.valid and r.reward == 0.0 for r in records)
    assert not episode.won and episode.outcome == 0.0
    with pytest.raises(RuntimeError):
        episode.act("look")


@pytest.mark.alfworld
def test_state_keys_follow_the_world_not_the_text(env):
    game = env.new_game()
    game.reset(task_of(env, LOOK_GAME))
    game.step("go to sidetable 1")
    empty_handed = game.step("look").observation
    game.step("take alarmclock 3 from sidetable 1")
    holding = game.step("look").observation
    # the same words, a different world: the clock is in hand
    assert holding.text == empty_handed.text == "You are facing the sidetable 1. Next to it, you see nothing."
    assert holding.state_key != empty_handed.state_key
    assert "inv: alarmclock 3" in holding.state_key and "inv: -" in empty_handed.state_key
    # put it back: the same world again, the same key
    game.step("put alarmclock 3 in/on sidetable 1")
    assert game.step("look").observation.state_key == empty_handed.state_key


@pytest.mark.alfworld
def test_a_second_reset_reuses_the_translation_and_keeps_argv(env, monkeypatch):
    import fast_downward

    monkeypatch.setattr("sys.argv", ["graft", "rollout"])
    task = task_of(env, "pick_and_place_simple-Book-None-Sofa-229")
    first = env.new_game().reset(task)
    hits = fast_downward.pddl2sas.cache_info().hits
    misses = fast_downward.pddl2sas.cache_info().misses
    games = [env.new_game() for _ in range(2)]  # two live games: the second needs a new engine
    assert all(g.reset(task) == first for g in games)
    assert fast_downward.pddl2sas.cache_info().misses == misses  # nothing translated again
    assert fast_downward.pddl2sas.cache_info().hits > hits
    assert sys.argv == ["graft", "rollout"]  # Fast Downward's translator overwrites it; restored


@pytest.mark.alfworld
def test_episodes_are_deterministic(env):
    task = task_of(env, "pick_two_obj_and_place-AlarmClock-None-Dresser-305")

    def trace():
        episode, records = play_expert(env, task)
        return [(r.observation, r.action, r.state, tuple(r.admissible)) for r in records] + [episode.current]

    first, second = trace(), trace()  # the second reuses the pooled engine
    assert first == second


@pytest.mark.alfworld
def test_expert_matches_the_package_wrapper_on_a_look_game(env):
    """Reference: the package's own AlfredExpert wrapper, driven as AlfredTWEnv drives it."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredExpert, AlfredInfos

    task = task_of(env, LOOK_GAME)
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "expert_plan"])
    wrappers = [AlfredDemangler(shuffle=False), AlfredInfos, AlfredExpert("handcoded")]
    reference = textworld.start(task.spec["game_file"], request_infos=infos, wrappers=wrappers)
    state, done, theirs = reference.reset(), False, []
    while not done and len(theirs) < 20:
        theirs.append(state["extra.expert_plan"][0])
        state, _, done = reference.step(theirs[-1])
    _, records = play_expert(env, task)
    assert [r.action for r in records] == theirs


# -- held-out warning ----------------------------------------------------------------------------


def test_train_and_eval_from_the_same_games_is_warned_once():
    from schemas.errors import GraftWarning

    needs_alfworld()
    shared = make_env("alfworld", data=str(DATA))  # the test data has only valid_seen
    with pytest.warns(GraftWarning, match="train and eval draw from the same games"):
        shared.games("train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared.games("eval")  # once per environment


def test_separate_train_and_eval_folders_are_not_warned(tmp_path):
    import shutil

    needs_alfworld()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        playable = make_env("alfworld", data=str(DATA)).games("eval")
    folders = sorted({e.game_file.parent.parent for e in playable})[:2]
    for split, folder in zip(("train", "valid_seen"), folders, strict=True):
        shutil.copytree(folder, tmp_path / "json_2.1.1" / split / folder.name)
    env = make_env("alfworld", data=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(env.games("train")) >= 1 and len(env.games("eval")) >= 1
    assert {e.task_id.split("/")[0] for e in env.games("train")} == {"train"}
