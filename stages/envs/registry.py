"""Environment registry: name -> constructor. Constructors take ``max_turns``, ``invalid_penalty``,
``data`` and the environment's own options as keyword arguments and reject unknown ones with a
GraftError listing the valid options."""

from __future__ import annotations

import importlib
from typing import Any

from schemas.errors import GraftError
from stages.envs.base import Environment

# name -> "module:factory"; imported lazily so optional packages (alfworld, textworld) stay optional.
ENVIRONMENTS: dict[str, str] = {
    "household": "stages.envs.household:make_household",
    "shop": "stages.envs.shop:make_shop",
    "search": "stages.envs.search:make_search",
    "alfworld": "stages.envs.alfworld_env:make_alfworld",
    "textworld": "stages.envs.textworld_env:make_textworld",
}


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build environment ``name`` with keyword options."""
    if name not in ENVIRONMENTS:
        raise GraftError(f"unknown environment '{name}'; environments: {', '.join(sorted(ENVIRONMENTS))}")
    module_name, factory = ENVIRONMENTS[name].split(":")
    module = importlib.import_module(module_name)
    return getattr(module, factory)(**kwargs)
