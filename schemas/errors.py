"""User-facing errors.

Anything the user can fix (a bad config, a bad table, missing data, an unknown estimator) raises
``GraftError`` with one line naming the file, row or key and what is wrong. The CLI turns it into
that line on stderr and exit code 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations


class GraftError(Exception):
    """An error caused by user input; its message is the one line the user sees."""

    exit_code = 2


class GraftWarning(UserWarning):
    """Something the user should know that does not stop the run (the CLI prints ``warning: ...``)."""
