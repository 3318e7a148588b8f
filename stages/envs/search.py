"""``search``: search-augmented question answering over a passage corpus (Search-R1 / SearchQA style).

Data (``data`` = a directory; "" = the generated multi-hop set shipped in ``stages/envs/data/multihop``):
``questions.jsonl`` rows ``{id, question, answers[], type, supporting_titles[]}`` and ``corpus.jsonl``
rows ``{id, title, text}`` (the format of ../shared/data/hotpotqa). Retrieval is BM25 (``bm25s``,
English stopwords) over "title. text", top ``topk`` passages (default 3).

Actions (what ``parser.parse_response("search", ...)`` returns): ``search: <query>`` shows
``<information>Doc 1(Title: ...) ...</information>``; ``answer: <text>`` ends the episode with outcome
1 when the answer matches one of the gold answers after SQuAD normalization (lowercase, punctuation
and articles removed, whitespace collapsed), else 0. Step reward 0 (the Episode wrapper adds the
invalid penalty, -0.01 in the search config); 4 turns by default. The admissible list is empty
(free-form): any parsed action is valid; a string that is neither form leaves the state unchanged.

The observation text is the question at reset and the latest ``<information>`` block after a search;
the state key is the raw interaction context (question, then every search and its result), so the
graph's similarity canonicalization is the natural default for this environment. One search already
takes the context past all-MiniLM-L6-v2's 256-word-piece window on HotpotQA (median 363 pieces, 690
after two); the encoder embeds such contexts whole in windows and the graph's structural rules keep
answered states apart (docs/credit.md, "Similarity states" -- why the key is not shortened instead).
"""

from __future__ import annotations

import functools
import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.errors import GraftError
from stages.envs.base import Observation, Task, Transition
from stages.envs.tasksets import build_task_list, check_options

ENV_NAME = "search"
SHIPPED_DATA = Path(__file__).parent / "data" / "multihop"
DEFAULTS: dict[str, Any] = {"topk": 3}
QUESTION_KEYS = {"id": str, "question": str, "answers": list}
CORPUS_KEYS = {"id": str, "title": str, "text": str}


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> bool:
    """Normalized exact match against any gold answer."""
    predicted = normalize_answer(prediction)
    return any(predicted == normalize_answer(answer) for answer in answers)


def _read_jsonl(path: Path, keys: dict[str, type]) -> list[dict[str, Any]]:
    if not path.is_file():
        raise GraftError(
            f"{path}: file not found (the search environment needs questions.jsonl and corpus.jsonl)"
        )
    rows = []
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise GraftError(f"{path}:{line_no}: not UTF-8 text (byte {exc.start} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GraftError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise GraftError(f"{path}:{line_no}: expected a JSON object")
            for key, kind in keys.items():
                if not isinstance(row.get(key), kind):
                    raise GraftError(f"{path}:{line_no}: key '{key}' missing or not a {kind.__name__}")
            rows.append(row)
    if not rows:
        raise GraftError(f"{path}: no rows")
    return rows


@dataclass
class SearchData:
    """Questions, passages and their BM25 index."""

    root: str
    questions: list[dict[str, Any]]
    passages: list[dict[str, Any]]
    retriever: Any

    def retrieve(self, query: str, k: int) -> list[dict[str, Any]]:
        """The top-k passages with a positive BM25 score, best first."""
        import bm25s

        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)
        if not tokens[0]:
            return []
        k = min(k, len(self.passages))
        ids, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [self.passages[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


@functools.lru_cache(maxsize=4)
def _load(root: str, stamp: tuple[float, float]) -> SearchData:
    try:
        import bm25s
    except ImportError:
        raise GraftError(
            "the search environment needs bm25s: pip install -e '.[envs]' in the graft checkout"
        ) from None
    base = Path(root)
    questions = _read_jsonl(base / "questions.jsonl", QUESTION_KEYS)
    passages = _read_jsonl(base / "corpus.jsonl", CORPUS_KEYS)
    for line_no, row in enumerate(questions, 1):
        if not row["answers"] or not all(isinstance(a, str) for a in row["answers"]):
            raise GraftError(
                f"{base / 'questions.jsonl'}: row {line_no}: 'answers' must be a non-empty list of strings"
            )
    texts = [f"{p['title']}. {p['text']}" for p in passages]
    tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False, return_ids=False)
    if not any(tokens):  # BM25 cannot index an empty vocabulary
        raise GraftError(
            f"{base / 'corpus.jsonl'}: no passage has a searchable word (all empty or English stop-words)"
        )
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    return SearchData(root, questions, passages, retriever)


def load_search_data(data: str) -> SearchData:
    """Load (cached while the files are unchanged) the question/corpus directory ``data``."""
    base = Path(data) if data else SHIPPED_DATA
    if not base.is_dir():
        raise GraftError(
            f"{base}: search data directory not found (expected questions.jsonl and corpus.jsonl)"
        )
    files = (base / "questions.jsonl", base / "corpus.jsonl")
    stamp = tuple(f.stat().st_mtime if f.exists() else 0.0 for f in files)
    return _load(str(base.resolve()), stamp)  # type: ignore[arg-type]


def format_information(passages: list[dict[str, Any]]) -> str:
    """Search-R1's result block: ``Doc i(Title: t) text`` lines inside <information> tags."""
    if not passages:
        return "<information>No results found.</information>"
    lines = [f"Doc {i}(Title: {p['title']}) {p['text']}" for i, p in enumerate(passages, 1)]
    return "<information>" + "\n".join(lines) + "</information>"


class SearchGame:
    """One question-answering episode."""

    def __init__(self, data: SearchData, topk: int) -> None:
        self.data = data
        self.topk = topk

    def reset(self, task: Task) -> Observation:
        self.question = task.spec["question"]
        self.answers = list(task.spec["answers"])
        self.supporting = list(task.spec.get("supporting_titles", []))
        self.context = f"Question: {self.question}"
        self.finished = False
        self.last_text = self.question
        return self._observation(self.question)

    def _observation(self, text: str) -> Observation:
        return Observation(text=text, admissible=[], state_key=self.context, task_text=self.question)

    def step(self, action: str) -> Transition:
        verb, _, argument = action.partition(": ")
        argument = argument.strip()
        if self.finished or verb not in ("search", "answer") or not argument:  # not an action: no change
            return Transition(
                observation=self._observation(self.last_text), reward=0.0, terminated=False, won=False
            )
        if verb == "search":
            text = format_information(self.data.retrieve(argument, self.topk))
            self.context += f"\n<search> {argument} </search>\n{text}"
            self.last_text = text
            return Transition(observation=self._observation(text), reward=0.0, terminated=False, won=False)
        won = exact_match(argument, self.answers)
        self.finished = True
        self.context += f"\n<answer> {argument} </answer>"
        text = f"Your answer: {argument}"
        self.last_text = text
        return Transition(
            observation=self._observation(text),
            reward=0.0,
            terminated=True,
            won=won,
            score=1.0 if won else 0.0,
            outcome=1.0 if won else 0.0,
        )

    def expert_action(self) -> str | None:
        """Search each supporting title not yet retrieved (once), then answer with the first gold answer."""
        if self.finished:
            return None
        for title in self.supporting:
            if f"(Title: {title})" not in self.context and f"<search> {title} </search>" not in self.context:
                return f"search: {title}"
        return f"answer: {self.answers[0]}"


class SearchEnv:
    """Task sets and games of search QA."""

    name = ENV_NAME
    prompt_style = "search"
    success_outcome = 1.0

    def __init__(self, max_turns: int, invalid_penalty: float, data: str, options: dict[str, Any]) -> None:
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.options = options
        self.data = load_search_data(data)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        questions = self.data.questions
        order = list(range(len(questions)))
        random.Random(f"search-order-{seed}").shuffle(order)

        def candidate(index: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
            row = questions[order[index % len(order)]]
            spec = {
                "id": row["id"],
                "question": row["question"],
                "answers": list(row["answers"]),
                "supporting_titles": list(row.get("supporting_titles", [])),
            }
            return str(row.get("type", "")), spec

        return build_task_list(ENV_NAME, split, count, seed, candidate, max_candidates=len(order))

    def new_game(self) -> SearchGame:
        return SearchGame(self.data, self.options["topk"])

    def failure_outcome(self, score: float) -> float:
        return 0.0


def make_search(
    max_turns: int = 4, invalid_penalty: float = -0.01, data: str = "", **options: Any
) -> SearchEnv:
    """Factory for the registry; ``data`` = a directory with questions.jsonl and corpus.jsonl."""
    opts = check_options(ENV_NAME, options, DEFAULTS)
    if opts["topk"] < 1:
        raise GraftError("environment 'search': option 'topk' must be >= 1")
    return SearchEnv(max_turns, invalid_penalty, data, opts)
