"""The household environment: contract, determinism, rules, state keys, expert, Episode handling."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import GraftError
from stages.envs.base import Episode, Task
from stages.envs.household import TASK_TYPES, HouseholdGame
from stages.envs.registry import make_env
from tests.helpers.expert_play import play_expert


def env_of(**options):
    return make_env("household", max_turns=50, invalid_penalty=-0.1, data="", **options)


def small_task(
    task_type="pick_clean_then_place_in_recep", prop="clean", count=1, light=False, target="shelf"
):
    """A hand-built room: cabinet 1 (closed), countertop 1, shelf 1, shelf 2, sinkbasin 1, sidetable 1."""
    spec = {
        "task_type": task_type,
        "text": "put a clean mug in shelf",
        "goal": {"object": "mug", "target": target, "property": prop, "count": count, "light": light},
        "receptacles": ["cabinet 1", "countertop 1", "shelf 1", "shelf 2", "sidetable 1", "sinkbasin 1"],
        "openable": ["cabinet 1"],
        "objects": [["mug 1", "cabinet 1"], ["apple 1", "countertop 1"], ["mug 2", "countertop 1"]],
        "lamp": ["desklamp 1", "sidetable 1"],
    }
    return Task(task_id="t", task_type=task_type, spec=spec)


def play(game: HouseholdGame, actions: list[str]):
    result = None
    for action in actions:
        assert action in game.admissible(), (action, game.admissible())
        result = game.step(action)
    return result


# --- factory and task sets ----------------------------------------------------------------------


def test_unknown_option_lists_valid_ones():
    with pytest.raises(GraftError, match=r"unknown option 'rooms'.*receptacles.*shuffle"):
        env_of(rooms=3)
    with pytest.raises(GraftError, match="option 'shuffle'"):
        env_of(shuffle="yes")
    with pytest.raises(GraftError, match="task_types"):
        env_of(task_types=["pick_and_fly"])


def test_environment_attributes():
    env = env_of()
    assert env.prompt_style == "alfworld"
    assert env.success_outcome == 10.0 and env.failure_outcome(0.0) == 0.0
    assert env.max_turns == 50 and env.invalid_penalty == -0.1


@pytest.mark.parametrize("options", [{}, {"shuffle": False}, {"receptacles": 15, "distractors": 8}])
def test_tasks_are_deterministic_disjoint_and_typed(options):
    env = env_of(**options)
    a = env.tasks("train", 24, seed=3)
    b = env_of(**options).tasks("train", 24, seed=3)
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert [t.spec for t in a] == [t.spec for t in b]
    assert {t.task_type for t in a} == set(TASK_TYPES)
    train_ids = {t.task_id for t in env.tasks("train", 60, seed=3)}
    eval_ids = {t.task_id for t in env.tasks("eval", 30, seed=3)}
    assert not train_ids & eval_ids
    assert env.tasks("train", 24, seed=4) != a
    with pytest.raises(GraftError, match="split"):
        env.tasks("test", 2, 0)


def test_same_task_gives_identical_worlds():
    env = env_of()
    task = env.tasks("train", 1, seed=0)[0]
    g1, g2 = env.new_game(), env.new_game()
    assert g1.reset(task) == g2.reset(task)
    for _ in range(4):
        action = g1.expert_action()
        assert g1.step(action) == g2.step(action)


def test_fixed_room_shared_by_all_tasks():
    tasks = env_of(shuffle=False).tasks("train", 12, seed=0)
    assert len({str(t.spec["objects"]) + str(t.spec["receptacles"]) for t in tasks}) == 1
    assert len({t.spec["text"] for t in tasks}) > 6


# --- rules and texts ------------------------------------------------------------------------------


def test_observation_texts_and_admissible_follow_alfworld():
    game = HouseholdGame()
    first = game.reset(small_task())
    assert first.text == (
        "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
        "you see a cabinet 1, a countertop 1, a shelf 1, a shelf 2, a sidetable 1, and a sinkbasin 1.\n\n"
        "Your task is to: put a clean mug in shelf."
    )
    assert first.task_text == "put a clean mug in shelf"
    assert first.admissible == [
        "go to cabinet 1",
        "go to countertop 1",
        "go to shelf 1",
        "go to shelf 2",
        "go to sidetable 1",
        "go to sinkbasin 1",
        "inventory",
        "look",
    ]
    arrive = game.step("go to cabinet 1").observation
    assert arrive.text == "You arrive at cabinet 1. The cabinet 1 is closed."
    assert "take mug 1 from cabinet 1" not in arrive.admissible and "open cabinet 1" in arrive.admissible
    opened = game.step("open cabinet 1").observation
    assert opened.text == "You open the cabinet 1. The cabinet 1 is open. In it, you see a mug 1."
    assert (
        game.step("take mug 1 from cabinet 1").observation.text == "You pick up the mug 1 from the cabinet 1."
    )
    assert game.step("inventory").observation.text == "You are carrying: a mug 1."
    assert game.step("examine mug 1").observation.text == "There's nothing special about mug 1."
    arrive = game.step("go to countertop 1").observation
    assert arrive.text == "You arrive at countertop 1. On the countertop 1, you see a apple 1, and a mug 2."
    assert "put mug 1 in/on countertop 1" in arrive.admissible
    assert not any(a.startswith("take") for a in arrive.admissible)  # hands are full
    assert (
        game.step("go to sinkbasin 1").observation.text
        == "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing."
    )
    assert (
        game.step("clean mug 1 with sinkbasin 1").observation.text
        == "You clean the mug 1 using the sinkbasin 1."
    )
    assert game.step("examine mug 1").observation.text == "This is a clean mug."
    assert game.step("fly away").observation.text == "Nothing happens."
    assert (
        game.step("look").observation.text == "You are facing the sinkbasin 1. Next to it, you see nothing."
    )
    game.step("go to shelf 2")
    final = game.step("put mug 1 in/on shelf 2")
    assert final.observation.text == "You put the mug 1 in/on the shelf 2."
    assert final.terminated and final.won and final.outcome == 10.0 and final.reward == 0.0


def test_goal_needs_the_property():
    game = HouseholdGame()
    game.reset(small_task())
    result = play(
        game,
        ["go to countertop 1", "take mug 2 from countertop 1", "go to shelf 1", "put mug 2 in/on shelf 1"],
    )
    assert not result.terminated and not result.won and result.outcome == 0.0
    result = play(game, ["take mug 2 from shelf 1", "go to sinkbasin 1", "clean mug 2 with sinkbasin 1"])
    assert not result.terminated
    assert play(game, ["go to shelf 1", "put mug 2 in/on shelf 1"]).won


def test_pick_two_needs_both_in_one_receptacle():
    game = HouseholdGame()
    game.reset(small_task("pick_two_obj_and_place", prop=None, count=2))
    steps = ["go to countertop 1", "take mug 2 from countertop 1", "go to shelf 1", "put mug 2 in/on shelf 1"]
    steps += ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "go to shelf 2"]
    assert not play(game, [*steps, "put mug 1 in/on shelf 2"]).terminated
    assert play(game, ["take mug 1 from shelf 2", "go to shelf 1", "put mug 1 in/on shelf 1"]).won


def test_look_needs_object_in_hand_and_lamp_on():
    game = HouseholdGame()
    game.reset(small_task("look_at_obj_in_light", prop=None, light=True, target=None))
    assert (
        play(game, ["go to sidetable 1", "use desklamp 1"]).observation.text == "You turn on the desklamp 1."
    )
    assert not game.won
    assert not play(game, ["go to countertop 1", "take mug 2 from countertop 1"]).terminated
    assert play(game, ["go to sidetable 1"]).won


def test_heat_and_cool_replace_each_other():
    game = HouseholdGame()
    spec = dict(
        small_task().spec,
        receptacles=["countertop 1", "fridge 1", "microwave 1"],
        openable=["fridge 1", "microwave 1"],
    )
    spec["objects"] = [["mug 1", "countertop 1"]]
    game.reset(Task("t", "pick_cool_then_place_in_recep", spec))
    play(
        game,
        [
            "go to countertop 1",
            "take mug 1 from countertop 1",
            "go to microwave 1",
            "heat mug 1 with microwave 1",
        ],
    )
    assert game.step("examine mug 1").observation.text == "This is a hot mug."
    play(game, ["go to fridge 1", "cool mug 1 with fridge 1"])
    assert game.step("examine mug 1").observation.text == "This is a cold mug."


# --- state keys -----------------------------------------------------------------------------------


def test_state_key_same_world_same_key():
    game = HouseholdGame()
    start = game.reset(small_task()).state_key
    play(game, ["go to cabinet 1", "open cabinet 1", "close cabinet 1", "go to shelf 1", "look", "inventory"])
    via_detour = game.state_key()
    other = HouseholdGame()
    other.reset(small_task())
    play(other, ["go to shelf 1"])
    assert via_detour == other.state_key() != start


def test_state_key_differs_when_text_is_the_same():
    a, b = HouseholdGame(), HouseholdGame()
    a.reset(small_task())
    b.reset(small_task())
    play(a, ["go to countertop 1", "take mug 2 from countertop 1", "go to shelf 1"])
    play(b, ["go to countertop 1", "take apple 1 from countertop 1", "go to shelf 1"])
    look_a, look_b = a.step("look").observation, b.step("look").observation
    assert look_a.text == look_b.text and look_a.state_key != look_b.state_key
    # an opened cabinet elsewhere: same arrival text, different world
    c, d = HouseholdGame(), HouseholdGame()
    c.reset(small_task())
    d.reset(small_task())
    play(c, ["go to cabinet 1", "open cabinet 1"])
    play(d, ["go to cabinet 1"])
    arrive_c, arrive_d = c.step("go to shelf 1").observation, d.step("go to shelf 1").observation
    assert arrive_c.text == arrive_d.text and arrive_c.state_key != arrive_d.state_key


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), walk=st.lists(st.integers(0, 1000), min_size=1, max_size=40))
def test_state_key_determines_what_the_agent_can_do(seed, walk):
    """Random walks: a key always comes with the same admissible set and goal status; replay is identical."""
    env = env_of()
    task = env.tasks("train", 1, seed=seed)[0]
    seen: dict[str, tuple] = {}
    keys = []
    game = env.new_game()
    obs = game.reset(task)
    for pick in walk:
        seen.setdefault(obs.state_key, (tuple(obs.admissible), game.won))
        assert seen[obs.state_key] == (tuple(obs.admissible), game.won)
        action = obs.admissible[pick % len(obs.admissible)]
        result = game.step(action)
        obs = result.observation
        keys.append((action, obs.state_key, obs.text))
        if result.terminated:
            break
    replay = env.new_game()
    replay.reset(task)
    assert [(a, replay.step(a).observation.state_key, replay.state_key()) for a, _, _ in keys] == [
        (a, k, k) for a, k, _ in keys
    ]


# --- expert ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,bound",
    [({}, 10), ({"shuffle": False}, 12), ({"receptacles": 16, "distractors": 10, "objects_per_type": 3}, 12)],
)
def test_expert_solves_every_type(options, bound):
    env = env_of(**options)
    tasks = env.tasks("train", 240, seed=11) + env.tasks("eval", 60, seed=11)
    per_type: dict[str, set[str]] = {}
    for task in tasks:
        game, result = play_expert(env, task, limit=bound)
        assert result is not None and result.won and result.outcome == 10.0, task.spec
        assert game.expert_action() is None
        per_type.setdefault(task.task_type, set()).add(task.task_id)
    assert set(per_type) == set(TASK_TYPES)
    if options.get("shuffle", True):  # a fixed room has only a few distinct goals per type
        assert min(len(ids) for ids in per_type.values()) >= 30


def test_expert_solves_tasks_of_many_seeds():
    env = env_of()
    types = set()
    for seed in range(100):
        for task in env.tasks("train", 4, seed=seed) + env.tasks("eval", 2, seed=seed):
            _, result = play_expert(env, task, limit=12)
            assert result is not None and result.won, (seed, task.spec)
            types.add(task.task_type)
    assert types == set(TASK_TYPES)


def test_small_setting_has_short_expert_solutions():
    env = env_of()
    lengths = []
    for task in env.tasks("train", 60, seed=0):
        game = env.new_game()
        game.reset(task)
        n = 0
        while (action := game.expert_action()) is not None:
            game.step(action)
            n += 1
        lengths.append(n)
    assert min(lengths) >= 3 and max(lengths) <= 10


def test_expert_recovers_from_random_detours():
    env = env_of()
    rng = random.Random(0)
    for task in env.tasks("train", 60, seed=5):
        game = env.new_game()
        obs = game.reset(task)
        for _ in range(rng.randrange(12)):
            result = game.step(rng.choice(obs.admissible))
            obs = result.observation
            if result.terminated:
                break
        for _ in range(40):
            if game.won:
                break
            obs = game.step(game.expert_action()).observation
        assert game.won


# --- Episode wrapper ------------------------------------------------------------------------------


def test_episode_invalid_actions_cost_and_do_not_advance():
    env = make_env("household", max_turns=4, invalid_penalty=-0.1, data="")
    task = env.tasks("train", 1, seed=0)[0]
    episode = Episode(env, task)
    before = episode.current
    for bad in (None, "dance wildly"):
        record = episode.act(bad)
        assert not record.valid and record.reward == -0.1
        assert record.state == record.next_state == before.state_key
        assert episode.current is before
    record = episode.act(episode.game.expert_action())
    assert record.valid and record.reward == 0.0 and record.next_state != record.state
    record = episode.act(None)
    assert record.done and record.truncated and not record.terminated
    assert episode.outcome == 0.0 and not episode.won and episode.turn == 4


def test_episode_win_and_error():
    env = env_of()
    task = env.tasks("train", 1, seed=2)[0]
    episode = Episode(env, task)
    while not episode.done:
        record = episode.act(episode.game.expert_action())
    assert record.terminated and episode.won and episode.outcome == 10.0

    episode = Episode(env, task)

    def boom(action):
        raise RuntimeError("engine failure")

    episode.game.step = boom
    record = episode.act(episode.current.admissible[0])
    assert record.done and record.truncated and record.error == "RuntimeError: engine failure"
    assert episode.error == record.error and episode.outcome == 0.0


# --- irreversible mistakes (option) ---------------------------------------------------------------


def test_a_misplaced_goal_object_is_recoverable_by_default():
    game = HouseholdGame()
    game.reset(small_task(prop=None))
    result = play(
        game, ["go to countertop 1", "take mug 2 from countertop 1", "put mug 2 in/on countertop 1"]
    )
    assert not result.terminated and "take mug 2 from countertop 1" in result.observation.admissible


def test_irreversible_a_goal_object_put_outside_the_target_ends_the_episode_lost():
    game = HouseholdGame(irreversible=True)
    game.reset(small_task(prop=None))
    before = play(game, ["go to countertop 1", "take mug 2 from countertop 1", "go to sidetable 1"])
    assert not before.terminated
    result = play(game, ["put mug 2 in/on sidetable 1"])
    assert result.terminated and not result.won and result.outcome == 0.0 and result.score == 0.0
    assert result.observation.text == "You put the mug 2 in/on the sidetable 1. The mug 2 breaks."
    assert result.observation.state_key.endswith("|broken=mug 2")
    assert game.expert_action() is None
    after = game.step("take mug 2 from sidetable 1")  # nothing can undo it
    assert after.observation.text == "Nothing happens." and after.terminated


def test_irreversible_spares_other_objects_and_the_goal_receptacles():
    game = HouseholdGame(irreversible=True)
    game.reset(small_task(prop=None))
    other = play(
        game, ["go to countertop 1", "take apple 1 from countertop 1", "put apple 1 in/on countertop 1"]
    )
    assert not other.terminated  # not the goal's kind: the put is reversible
    result = play(game, ["take mug 2 from countertop 1", "go to shelf 2", "put mug 2 in/on shelf 2"])
    assert result.won and result.terminated  # shelf 2 is a goal receptacle (kind "shelf")
    game.reset(small_task(prop="clean"))
    unclean = play(
        game,
        ["go to countertop 1", "take mug 2 from countertop 1", "go to shelf 1", "put mug 2 in/on shelf 1"],
    )
    assert not unclean.terminated  # right place, property missing: take it back, clean it
    assert (
        play(
            game, ["take mug 2 from shelf 1", "go to sinkbasin 1", "clean mug 2 with sinkbasin 1"]
        ).terminated
        is False
    )


def test_irreversible_in_a_light_task_any_put_of_the_goal_object_breaks_it():
    game = HouseholdGame(irreversible=True)
    game.reset(small_task("look_at_obj_in_light", prop=None, light=True, target=None))
    result = play(
        game, ["go to countertop 1", "take mug 2 from countertop 1", "put mug 2 in/on countertop 1"]
    )
    assert result.terminated and not result.won


def test_the_expert_never_makes_the_irreversible_mistake():
    env = env_of(irreversible=True)
    for task in env.tasks("train", 120, seed=5) + env.tasks("eval", 30, seed=5):
        _, result = play_expert(env, task, limit=40)
        assert result is not None and result.won, task.spec
    with pytest.raises(GraftError, match="option 'irreversible' = 'yes' is invalid; expected bool"):
        env_of(irreversible="yes")
