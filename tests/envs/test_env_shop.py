"""The shop environment: catalog and tasks, pages and actions, WebShop reward, state keys, expert."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.errors import GraftError
from stages.envs.base import Episode
from stages.envs.registry import make_env
from stages.envs.shop import Product, build_catalog, instruction_text, score_purchase
from tests.helpers.expert_play import play_expert


def env_of(**options):
    return make_env("shop", data="", **options)


def test_factory_defaults_and_options():
    env = env_of()
    assert env.prompt_style == "webshop" and env.max_turns == 15 and env.success_outcome == 10.0
    assert env.failure_outcome(0.8) == 0.0
    with pytest.raises(GraftError, match=r"unknown option 'colour'.*catalog_seed.*page_size"):
        env_of(colour="red")
    with pytest.raises(GraftError, match="page_size"):
        env_of(page_size="ten")


def test_catalog_and_tasks_are_deterministic_and_disjoint():
    assert build_catalog(3, 5, 6) == build_catalog.__wrapped__(3, 5, 6)
    assert build_catalog(3, 5, 6) != build_catalog.__wrapped__(4, 5, 6)
    env = env_of()
    a, b = env.tasks("train", 20, seed=1), env_of().tasks("train", 20, seed=1)
    assert [t.spec for t in a] == [t.spec for t in b] and [t.task_id for t in a] == [t.task_id for t in b]
    train = {t.task_id for t in env.tasks("train", 80, 1)}
    evals = {t.task_id for t in env.tasks("eval", 20, 1)}
    assert train and evals and not train & evals
    for task in a:
        goal = task.spec["goal"]
        assert task.task_type == goal["category"]
        assert task.spec["instruction"] == instruction_text(goal)


def test_instruction_text():
    goal = {
        "type": "t-shirt",
        "attributes": ["cotton", "short sleeve"],
        "options": {"color": "navy", "size": "large"},
        "price": 40.0,
    }
    assert instruction_text(goal) == (
        "i need a t-shirt with cotton, short sleeve, and color: navy, and size: large, "
        "and price lower than 40.00 dollars"
    )


GOAL = {
    "type": "t-shirt",
    "category": "clothing",
    "attributes": ["cotton", "short sleeve"],
    "options": {"color": "navy", "size": "large"},
    "price": 40.0,
}


def product(ptype="t-shirt", category="clothing", attributes=("cotton", "slim fit"), price=45.0):
    options = (("color", ("navy", "red")), ("size", ("small", "large")))
    return Product("b0test", ptype, category, "x", attributes, options, price, "")


def test_score_matches_webshop_formula_by_hand():
    # matched: 1 attribute (cotton) + 1 option (navy) + price 45 > 40 -> 0 ; denominator 2 + 2 + 1 = 5
    assert score_purchase(GOAL, product(), {"color": "navy"}) == pytest.approx(2 / 5)
    assert score_purchase(GOAL, product(price=39.99), {"color": "navy", "size": "large"}) == pytest.approx(
        4 / 5
    )
    perfect = product(attributes=("cotton", "short sleeve", "crew neck"), price=40.0)
    assert score_purchase(GOAL, perfect, {"color": "navy", "size": "large"}) == 1.0
    assert score_purchase(GOAL, product("hoodie"), {"color": "navy"}) == pytest.approx(0.5 * 2 / 5)
    assert score_purchase(GOAL, product("coffee", "grocery"), {"color": "navy"}) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    attrs=st.sets(st.sampled_from(["cotton", "short sleeve", "slim fit", "crew neck"])),
    chosen=st.dictionaries(
        st.sampled_from(["color", "size"]), st.sampled_from(["navy", "red", "large", "small"])
    ),
    price=st.floats(1, 100),
)
def test_score_is_a_fraction_of_matches(attrs, chosen, price):
    score = score_purchase(GOAL, product(attributes=tuple(attrs), price=price), chosen)
    matches = len(attrs & {"cotton", "short sleeve"}) + len(set(chosen.values()) & {"navy", "large"})
    assert score * 5 == pytest.approx(matches + (price <= 40.0))


def test_expert_reaches_score_one():
    for options in ({}, {"types": 14, "products_per_type": 25, "page_size": 5, "goal_attributes": 3}):
        env = env_of(**options)
        for task in env.tasks("train", 150, seed=2) + env.tasks("eval", 40, seed=2):
            game, result = play_expert(env, task, limit=15)
            assert result is not None and result.won and result.score == 1.0 and result.outcome == 10.0
            assert game.expert_action() is None


def test_pages_and_navigation():
    env = env_of(page_size=5)
    task = env.tasks("train", 1, seed=0)[0]
    game = env.new_game()
    start = game.reset(task)
    assert start.text == f"WebShop [SEP] Instruction: [SEP] {task.spec['instruction']} [SEP] Search"
    types = sorted({p.ptype for p in build_catalog(0, 8, 12)})
    assert start.admissible == [f"search[{t}]" for t in types]
    results = game.step(f"search[{task.spec['goal']['type']}]").observation
    assert "Page 1 (Total results: 12)" in results.text
    assert (
        results.admissible[:2] == ["click[back to search]", "click[next >]"] and len(results.admissible) == 7
    )
    page2 = game.step("click[next >]").observation
    assert "click[< prev]" in page2.admissible and "click[next >]" in page2.admissible
    assert game.step("click[< prev]").observation.state_key == results.state_key
    item = results.admissible[2][6:-1]
    item_page = game.step(f"click[{item}]").observation
    assert {"click[buy now]", "click[description]", "click[features]", "click[< prev]"} <= set(
        item_page.admissible
    )
    features = game.step("click[features]").observation
    attributes = game.by_asin[item].attributes
    assert features.text.endswith(" [SEP] ".join(attributes))
    assert game.step("click[< prev]").observation.state_key == item_page.state_key
    assert game.step("click[< prev]").observation.state_key == results.state_key
    assert game.step("click[back to search]").observation.state_key == start.state_key
    assert game.step("click[buy now]").observation.text == start.text  # not admissible: nothing changes


def test_state_key_sees_selected_options_behind_identical_text():
    env = env_of()
    task = env.tasks("train", 1, seed=0)[0]
    goal = task.spec["goal"]
    a, b = env.new_game(), env.new_game()
    for game in (a, b):
        game.reset(task)
        game.step(f"search[{goal['type']}]")
        while (action := game.expert_action()) != f"click[{goal['asin']}]":
            game.step(action)
        game.step(action)
    first_value = next(iter(goal["options"].values()))
    a.step(f"click[{first_value}]")
    desc_a, desc_b = a.step("click[description]").observation, b.step("click[description]").observation
    assert desc_a.text == desc_b.text and desc_a.state_key != desc_b.state_key
    assert "opts=" in desc_a.state_key and first_value in desc_a.state_key


def test_wrong_purchase_ends_with_partial_score():
    env = env_of()
    task = env.tasks("train", 1, seed=0)[0]
    game = env.new_game()
    game.reset(task)
    game.step(f"search[{task.spec['goal']['type']}]")
    while (action := game.expert_action()).startswith("click[next"):
        game.step(action)
    game.step(action)  # the goal item, no option selected
    result = game.step("click[buy now]")
    goal = task.spec["goal"]
    expected = (len(goal["attributes"]) + 1) / (len(goal["attributes"]) + len(goal["options"]) + 1)
    assert result.terminated and not result.won and result.outcome == 0.0
    assert result.score == pytest.approx(expected)
    assert result.observation.admissible == [] and result.observation.text.endswith(f"{expected:.2f}")


def test_episode_invalid_and_truncation():
    env = make_env("shop", max_turns=3, invalid_penalty=-0.1, data="")
    episode = Episode(env, env.tasks("train", 1, seed=0)[0])
    record = episode.act("click[buy now]")  # not admissible on the search page
    assert not record.valid and record.reward == -0.1 and record.state == record.next_state
    record = episode.act(episode.game.expert_action())
    assert record.valid and record.reward == 0.0 and record.state != record.next_state
    record = episode.act(None)
    assert record.done and record.truncated and episode.outcome == 0.0 and episode.turn == 3
