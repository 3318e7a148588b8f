"""Parse a model response into the action string the environment receives.

- ``alfworld`` / ``webshop`` styles: the text of the last ``<action>...</action>``, stripped, runs of
  whitespace collapsed, lowercased (ALFWorld's commands and our shop's are lowercase).
- ``search`` style: ``<search>q</search>`` -> ``"search: q"``, ``<answer>a</answer>`` -> ``"answer: a"``
  (the last one; content stripped and whitespace collapsed, case kept).

Reasoning inside ``<think>...</think>`` is removed first, so a tag mentioned while thinking does not
count. ``None`` (an invalid turn) when the tag is missing or empty, or when a search response holds
both a search and an answer. Admissibility is checked by ``Episode`` against the observation's list.
"""

from __future__ import annotations

import re

from schemas.errors import GraftError

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_TAGS = {
    name: re.compile(rf"<{name}>(.*?)</{name}>", re.DOTALL | re.IGNORECASE)
    for name in ("action", "search", "answer")
}


def _last(tag: str, text: str) -> str | None:
    found = _TAGS[tag].findall(text)
    return found[-1].strip() if found else None


def parse_response(style: str, text: str) -> str | None:
    """The environment action in ``text``, or None when it has no valid one."""
    body = _THINK.sub(" ", text)
    if style in ("alfworld", "webshop"):
        action = _last("action", body)
        return " ".join(action.lower().split()) if action else None
    if style == "search":
        query, answer = _last("search", body), _last("answer", body)
        if query is not None and answer is not None:
            return None
        if query:
            return f"search: {' '.join(query.split())}"
        if answer:
            return f"answer: {' '.join(answer.split())}"
        return None
    raise GraftError(f"unknown prompt style '{style}'; styles: alfworld, webshop, search")
