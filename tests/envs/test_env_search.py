"""The search environment: data loading, BM25 retrieval, answers, state keys, Episode rules."""

from __future__ import annotations

import json

import pytest

from schemas.errors import GraftError
from stages.envs.base import Episode
from stages.envs.parser import parse_response
from stages.envs.prompts import build_prompt
from stages.envs.registry import make_env
from stages.envs.search import (
    SHIPPED_DATA,
    exact_match,
    format_information,
    load_search_data,
    normalize_answer,
)
from tests.helpers.paths import SHARED_DATA
from tools import make_search_data

HOTPOTQA = SHARED_DATA / "hotpotqa"


def env_of(data="", **options):
    return make_env("search", max_turns=4, invalid_penalty=-0.01, data=data, **options)


@pytest.mark.parametrize(
    "text,normal",
    [
        ("The Eiffel  Tower!", "eiffel tower"),
        ("an Apple, a day", "apple day"),
        ("  U.S.A. ", "usa"),
        ("Theatre", "theatre"),
    ],
)
def test_squad_normalization(text, normal):
    assert normalize_answer(text) == normal


def test_exact_match_any_answer():
    assert exact_match("the Beatles", ["Beatles", "Fab Four"])
    assert exact_match("fab four.", ["Beatles", "Fab Four"])
    assert not exact_match("Beatles band", ["Beatles"])


def test_shipped_data_is_what_the_generator_writes(tmp_path):
    make_search_data.write(tmp_path)
    for name in ("questions.jsonl", "corpus.jsonl"):
        assert (tmp_path / name).read_text() == (SHIPPED_DATA / name).read_text()
    questions = [json.loads(line) for line in (SHIPPED_DATA / "questions.jsonl").read_text().splitlines()]
    titles = {json.loads(line)["title"] for line in (SHIPPED_DATA / "corpus.jsonl").read_text().splitlines()}
    assert len(questions) == 200 and {q["type"] for q in questions} == {"bridge", "comparison"}
    assert all(set(q["supporting_titles"]) <= titles for q in questions)


def test_environment_contract_and_tasks():
    env = env_of()
    assert env.prompt_style == "search" and env.success_outcome == 1.0 and env.max_turns == 4
    a, b = env.tasks("train", 30, seed=0), env_of().tasks("train", 30, seed=0)
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert {t.task_type for t in a} == {"bridge", "comparison"}
    train = {t.task_id for t in env.tasks("train", 200, seed=0)}
    evals = {t.task_id for t in env.tasks("eval", 200, seed=0)}
    assert not train & evals and len(train) + len(evals) == 200
    with pytest.raises(GraftError, match=r"unknown option 'k'.*topk"):
        env_of(k=3)


def test_search_answer_and_state_keys():
    env = env_of(topk=2)
    task = next(t for t in env.tasks("train", 50, seed=0) if t.task_type == "bridge")
    game = env.new_game()
    first = game.reset(task)
    question = task.spec["question"]
    assert first.text == question and first.admissible == [] and first.state_key == f"Question: {question}"
    bridge = task.spec["supporting_titles"][0]
    result = game.step(f"search: {bridge}")
    passages = env.data.retrieve(bridge, 2)
    assert passages[0]["title"] == bridge
    assert result.observation.text == format_information(passages)
    assert result.observation.text.startswith(f"<information>Doc 1(Title: {bridge}) ")
    assert (
        result.observation.state_key
        == f"Question: {question}\n<search> {bridge} </search>\n{result.observation.text}"
    )
    assert not result.terminated and result.reward == 0.0
    wrong = game.step("answer: certainly not this")
    assert wrong.terminated and not wrong.won and wrong.outcome == 0.0
    game.reset(task)
    right = game.step(f"answer: {task.spec['answers'][0].upper()}!")
    assert right.terminated and right.won and right.outcome == 1.0 and right.score == 1.0


def test_same_results_for_different_queries_are_different_states():
    env = env_of(topk=1)
    task = env.tasks("train", 1, seed=0)[0]
    title = task.spec["supporting_titles"][0]
    a, b = env.new_game(), env.new_game()
    a.reset(task)
    b.reset(task)
    ra, rb = a.step(f"search: {title}"), b.step(f"search: {title} ?")
    assert ra.observation.text == rb.observation.text and ra.observation.state_key != rb.observation.state_key
    c = env.new_game()
    c.reset(task)
    assert c.step(f"search: {title}").observation.state_key == ra.observation.state_key


def test_expert_answers_every_shipped_question():
    env = env_of()
    tasks = env.tasks("train", 200, seed=0) + env.tasks("eval", 200, seed=0)
    won = 0
    for task in {t.task_id: t for t in tasks}.values():
        episode = Episode(env, task)
        while not episode.done:
            episode.act(episode.game.expert_action())
        won += episode.won
        assert episode.turn == 3  # two searches and an answer: every question needs two passages
    assert won == 200


def test_episode_invalid_truncation_and_prompt():
    env = env_of()
    task = env.tasks("train", 1, seed=0)[0]
    episode = Episode(env, task)
    record = episode.act(parse_response("search", "<search>a</search><answer>b</answer>"))
    assert not record.valid and record.reward == -0.01 and record.state == record.next_state
    episode.act(
        parse_response("search", f"<think>x</think><search>{task.spec['supporting_titles'][0]}</search>")
    )
    prompt = build_prompt(
        "search",
        task_text=episode.current.task_text,
        observation=episode.current.text,
        admissible=[],
        history=episode.history,
        step_count=episode.turn,
        history_length=-1,
    )
    memory = f"<search> {task.spec['supporting_titles'][0]} </search>\n{episode.current.text}"
    assert f"History:\n{memory}\nNow it's your turn" in prompt
    episode.act(None)
    record = episode.act("search: more")
    assert record.done and record.truncated and not record.terminated and episode.outcome == 0.0


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(GraftError, match="not found"):
        env_of(data=str(tmp_path / "missing"))
    (tmp_path / "questions.jsonl").write_text('{"id": "q1", "question": "Q?", "answers": ["a"]}\n')
    with pytest.raises(GraftError, match=r"corpus.jsonl: file not found"):
        env_of(data=str(tmp_path))
    (tmp_path / "corpus.jsonl").write_text(
        '{"id": "d1", "title": "T", "text": "t"}\n{"id": "d2", "title": 3}\n'
    )
    with pytest.raises(GraftError, match=r"corpus.jsonl:2: key 'title'"):
        env_of(data=str(tmp_path))
    (tmp_path / "corpus.jsonl").write_text('{"id": "d1", "title": "T", "text": "t"}\nnot json\n')
    with pytest.raises(GraftError, match=r"corpus.jsonl:2: invalid JSON"):
        env_of(data=str(tmp_path))
    (tmp_path / "corpus.jsonl").write_bytes(
        b'{"id": "d1", "title": "T", "text": "t"}\n{"id": "d2", "title": "caf\xe9"}\n'
    )
    with pytest.raises(GraftError, match=r"corpus.jsonl:2: not UTF-8 text \(byte 26 of the line\)"):
        env_of(data=str(tmp_path))
    (tmp_path / "corpus.jsonl").write_text(
        '{"id": "d1", "title": "The", "text": "it is a"}\n{"id": "d2", "title": "", "text": "of the"}\n'
    )
    with pytest.raises(GraftError, match=r"corpus.jsonl: no passage has a searchable word"):
        env_of(data=str(tmp_path))


def test_hotpotqa_retrieval_recall():
    """Recall@3 of at least one supporting passage with the question as query (measured 0.95)."""
    if not (HOTPOTQA / "questions.jsonl").is_file():
        pytest.skip(f"HotpotQA sample not found at {HOTPOTQA}")
    data = load_search_data(str(HOTPOTQA))
    env = env_of(data=str(HOTPOTQA))
    assert {t.task_type for t in env.tasks("train", 40, seed=0)} == {"bridge", "comparison"}
    hits = [
        bool({p["title"] for p in data.retrieve(q["question"], 3)} & set(q["supporting_titles"]))
        for q in data.questions
    ]
    assert len(hits) == 100 and sum(hits) / len(hits) >= 0.85
