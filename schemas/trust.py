"""Which settings of a config run code, and whether this process honours them from saved runs
(``graft --trust-run``).

Kept apart from schemas.rundir (which imports polars) so that the CLI can set it without loading
the table libraries for ``--help``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas.errors import GraftError

if TYPE_CHECKING:
    from schemas.config import Config

_TRUST_RUNS = [False]


def trust_saved_runs(enabled: bool) -> None:
    """Honour code-running settings from saved run configs without repeating them (``--trust-run``)."""
    _TRUST_RUNS[0] = bool(enabled)


def saved_runs_trusted() -> bool:
    return _TRUST_RUNS[0]


# A run directory is data, not code (docs/design.md §11): someone else's run must not run Python on this machine
# through its saved config. ``graft --trust-run`` (schemas.trust) turns the rule off for one process.


def code_running_settings(config: Config) -> dict[str, str]:
    """The settings of ``config`` that make graft import or execute code: {key: value as text}."""
    found = {}
    if config.model.trust_remote_code:
        found["model.trust_remote_code"] = "true"
    if ":" in config.env.name:  # "module:Factory": a plug-in environment, imported by name
        found["env.name"] = config.env.name
    return found


def refuse_code_from_run(source: Path, config: Config, overrides: list[str] | tuple[str, ...]) -> None:
    """GraftError when a code-running setting comes from ``source`` (a saved run config) and is not set
    by the command line's own ``overrides``."""
    given = {item.split("=", 1)[0].strip() for item in overrides if "=" in item}
    for key, value in code_running_settings(config).items():
        if key not in given:
            raise GraftError(
                f"{source}: {key} = {value} runs code from the run directory, which is data; repeat it "
                f"on the command line (--set {key}={value}) or pass graft --trust-run to honour it"
            )
