"""Text from someone else's run shown on a terminal: control characters and bidirectional overrides
written as escapes, so that no cell, path or key can send escape sequences, break a line or reorder
what the terminal shows after it (U+202E)."""

from __future__ import annotations

import re

# C0/C1 controls, and the Unicode bidirectional formatting characters (marks, embeddings, overrides,
# isolates)
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every such character written as its escape (``\\n``, ``\\x1b``, ``\\u202e``)."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
