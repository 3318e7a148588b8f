"""Whether this process honours code-running settings from saved runs (``graft --trust-run``).

Kept apart from schemas.rundir (which imports polars) so that the CLI can set it without loading
the table libraries for ``--help``.
"""

from __future__ import annotations

_TRUST_RUNS = [False]


def trust_saved_runs(enabled: bool) -> None:
    """Honour code-running settings from saved run configs without repeating them (``--trust-run``)."""
    _TRUST_RUNS[0] = bool(enabled)


def saved_runs_trusted() -> bool:
    return _TRUST_RUNS[0]
