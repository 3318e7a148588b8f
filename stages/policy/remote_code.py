"""Custom modelling code a model directory ships (``model.trust_remote_code``) runs inside graft:
whatever it raises while a model or tokenizer loads is the model directory's problem, named in one
line, not a traceback through transformers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from schemas.errors import GraftError


@contextmanager
def remote_code_errors(path: str | Path, trusted: bool) -> Iterator[None]:
    """Turn any exception raised while loading ``path`` with its own code (``trusted``) into one
    GraftError naming the directory; without trust nothing is caught here."""
    if not trusted:
        yield
        return
    try:
        yield
    except GraftError:
        raise
    except Exception as exc:  # the directory's own code: anything it raises
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        raise GraftError(
            f"{path}: its own code (model.trust_remote_code) raised {type(exc).__name__}"
            + (f": {first}" if first else "")
        ) from None
