"""Prompt templates (paper Fig. 11–13) and response parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import GraftError
from stages.envs.parser import parse_response
from stages.envs.prompts import build_prompt

THINK_ACTION = (
    "This reasoning process MUST be enclosed within <think> </think> tags. Once you've finished your "
    "reasoning, you should choose an admissible action for current step and present it within "
    "<action> </action> tags."
)


def test_alfworld_prompt_with_history_window():
    history = [("o1", "go to desk 1"), ("o2", "look"), ("o3", "take pen 1 from desk 1")]
    text = build_prompt(
        "alfworld",
        task_text="put a pen in shelf",
        observation="You pick up the pen 1 from the desk 1.",
        admissible=["go to shelf 1", "inventory"],
        history=history,
        step_count=3,
        history_length=2,
    )
    assert text == (
        "You are an expert agent operating in the ALFRED embodied environment. Your task is to: put a pen in "
        "shelf. Prior to this step, you have already taken 3 step(s). Below are the most recent 2 "
        "observations and the corresponding actions you took: [Observation 2: 'o2', Action 2: 'look']\n"
        "[Observation 3: 'o3', Action 3: 'take pen 1 from desk 1']. You are now at step 4 and your current "
        "observation is: You pick up the pen 1 from the desk 1.. Your admissible actions of the current "
        "situation are: ['go to shelf 1', 'inventory'].\n\n"
        "Now it's your turn to take an action. You should first reason step-by-step about the current "
        "situation. " + THINK_ACTION
    )
    everything = build_prompt(
        "alfworld",
        task_text="t",
        observation="o",
        admissible=[],
        history=history,
        step_count=3,
        history_length=-1,
    )
    assert (
        "most recent 3 observations" in everything
        and "[Observation 1: 'o1', Action 1: 'go to desk 1']" in everything
    )


def test_first_step_has_no_history_sentence():
    text = build_prompt(
        "alfworld",
        task_text="t",
        observation="o",
        admissible=["look"],
        history=[],
        step_count=0,
        history_length=2,
    )
    assert text.startswith(
        "You are an expert agent operating in the ALFRED embodied environment. Your task is to: t. "
        "You are now at step 1 and your current observation is: o. "
        "Your admissible actions of the current situation are: ['look'].\n\n"
    )
    assert "Prior to this step" not in text


def test_webshop_prompt():
    text = build_prompt(
        "webshop",
        task_text="i need a red shirt",
        observation="page",
        admissible=["search[red shirt]"],
        history=[("start", "search[red shirt]")],
        step_count=1,
        history_length=2,
    )
    assert text == (
        "You are an expert autonomous agent operating in the WebShop e-commerce environment. Your task is "
        "to: i need a red shirt. Prior to this step, you have already taken 1 step(s). Below are the most "
        "recent 1 observations and the corresponding actions you took: [Observation 1: 'start', Action 1: "
        "'search[red shirt]']. You are now at step 2 and your current observation is: page. Your admissible "
        "actions for the current situation are: ['search[red shirt]'].\n\n"
        "Now it's your turn to take one action for the current step. You should first reason step-by-step "
        "about the current situation, then think carefully which admissible action best advances the "
        "shopping goal. " + THINK_ACTION
    )


SEARCH_TAIL = (
    "Now it's your turn to respond for the current step. You should first conduct reasoning process. "
    "This process MUST be enclosed within <think> </think> tags.\n"
    "After completing your reasoning, choose only one of the following actions (do not perform both):\n"
    "(1) If you find you lack some knowledge, you can call a search engine to get more external "
    "information using format: <search> your query </search>.\n"
    "(2) If you have enough knowledge to answer the question confidently, provide your final answer within "
    "<answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>."
)


def test_search_prompt_with_memory():
    history = [
        ("Who?", "search: alpha"),
        ("<information>A</information>", ""),
        ("<information>A</information>", "search: beta"),
    ]
    text = build_prompt(
        "search",
        task_text="Who?",
        observation="<information>B</information>",
        admissible=[],
        history=history,
        step_count=3,
        history_length=2,  # ignored: search shows everything
    )
    assert text == (
        "You are an expert agent tasked with answering the given question step-by-step.\n"
        "Your question: Who?.\n"
        "Prior to this step, you have already taken 3 step(s). Below is the interaction history where "
        "<search> </search> wrapped your past search queries and <information> </information> wrapped the "
        "corresponding search results returned by the external search engine.\n"
        "History:\n<search> alpha </search>\n<information>A</information>\n<search> beta </search>\n"
        "<information>B</information>\n" + SEARCH_TAIL
    )
    first = build_prompt(
        "search", task_text="Q", observation="Q", admissible=[], history=[], step_count=0, history_length=-1
    )
    assert first == (
        "You are an expert agent tasked with answering the given question step-by-step.\nYour question: Q.\n"
        + SEARCH_TAIL
    )


def test_unknown_style():
    with pytest.raises(GraftError, match="styles"):
        build_prompt(
            "chess", task_text="", observation="", admissible=[], history=[], step_count=0, history_length=2
        )
    with pytest.raises(GraftError, match="styles"):
        parse_response("chess", "<action>x</action>")


@pytest.mark.parametrize(
    "style,text,expected",
    [
        ("alfworld", "<think>go</think> <action> Go To  Desk 1 </action>", "go to desk 1"),
        ("alfworld", "<action>look</action> then <action>inventory</action>", "inventory"),
        ("alfworld", "<think>maybe <action>look</action></think>", None),
        ("alfworld", "<action>  </action>", None),
        ("alfworld", "go to desk 1", None),
        ("alfworld", "<action>look", None),
        ("webshop", "<think>x</think><action>click[Buy Now]</action>", "click[buy now]"),
        ("search", "<think>hm</think><search> capital of  France </search>", "search: capital of France"),
        ("search", "<answer>Paris</answer>", "answer: Paris"),
        ("search", "<search>a</search><answer>b</answer>", None),
        ("search", "<think><answer>x</answer></think><search>q</search>", "search: q"),
        ("search", "<search></search>", None),
        ("search", "Paris", None),
    ],
)
def test_parse_response(style, text, expected):
    assert parse_response(style, text) == expected


@given(st.text(alphabet=st.characters(blacklist_characters="<>"), min_size=1))
def test_parse_roundtrip(action):
    parsed = parse_response("alfworld", f"<think>r</think><action>{action}</action>")
    words = " ".join(action.lower().split())
    assert parsed == (words or None)
