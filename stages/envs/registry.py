"""Environment registry: name -> constructor. Constructors take ``max_turns``, ``invalid_penalty``,
``data`` and the environment's own options as keyword arguments and reject unknown ones with a
GraftError listing the valid options.

``env.name`` is a built-in name, ``"package.module:Attribute"`` (a class or factory importable from
``sys.path``), or the name of an entry point in the ``graft.environments`` group of an installed
package. A plug-in is checked against the interface of ``stages/envs/base.py`` once it is built, so a
missing method is one clear error instead of a traceback in the middle of a rollout
(docs/environments.md).
"""

from __future__ import annotations

import importlib
import inspect
import numbers
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from schemas.config import Config
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
ENTRY_POINT_GROUP = "graft.environments"
GUIDE = "docs/environments.md"

# what a plug-in must provide (stages/envs/base.py): attribute -> expected kind
ENV_ATTRIBUTES: dict[str, str] = {
    "name": "str",
    "prompt_style": "str",
    "max_turns": "int",
    "invalid_penalty": "number",
    "success_outcome": "number",
    "tasks": "method",
    "new_game": "method",
    "failure_outcome": "method",
}
GAME_METHODS = ("reset", "step", "expert_action")


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build environment ``name`` with keyword options."""
    if name in ENVIRONMENTS:
        module_name, factory = ENVIRONMENTS[name].split(":")
        return getattr(importlib.import_module(module_name), factory)(**kwargs)
    factory = load_plugin(name)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise GraftError(
            f"env.name '{name}': cannot be called with {', '.join(sorted(kwargs))} ({exc}); a constructor "
            f"takes max_turns, invalid_penalty, data and the [env] options as keywords ({GUIDE})"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): let the call itself decide
        pass
    try:
        env = factory(**kwargs)
    except GraftError:
        raise
    except Exception as exc:  # the plug-in's own constructor failed
        raise GraftError(f"env.name '{name}': its constructor raised {type(exc).__name__}: {exc}") from None
    check_environment(env, name)
    return env


def make_environment(config: Config, options: dict | None = None) -> Environment:
    """The run's environment (``options``: instead of ``env.options``)."""
    return make_env(
        config.env.name,
        max_turns=config.env.max_turns,
        invalid_penalty=config.env.invalid_penalty,
        data=config.env.data,
        **(config.env.options if options is None else options),
    )


def load_plugin(name: str) -> Callable[..., Any]:
    """The class or factory named by ``module:attribute`` or by a ``graft.environments`` entry point."""
    if ":" not in name:
        points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if name not in points:
            known = sorted(ENVIRONMENTS) + sorted(points)
            raise GraftError(
                f"unknown environment '{name}'; environments: {', '.join(known)} "
                f"(or 'package.module:Class' for your own, {GUIDE})"
            )
        try:
            loaded = points[name].load()
        except Exception as exc:
            raise GraftError(
                f"env.name '{name}': entry point {points[name].value} does not load "
                f"({type(exc).__name__}: {exc})"
            ) from None
    else:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise GraftError(f"env.name '{name}': expected 'package.module:Class'")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # ImportError, or the module's own error while importing
            raise GraftError(
                f"env.name '{name}': cannot import module '{module_name}' ({type(exc).__name__}: {exc}); "
                "is its directory on PYTHONPATH?"
            ) from None
        loaded = module
        for part in attr.split("."):
            if not hasattr(loaded, part):
                raise GraftError(f"env.name '{name}': module '{module_name}' has no attribute '{attr}'")
            loaded = getattr(loaded, part)
    if not callable(loaded):
        raise GraftError(f"env.name '{name}': {loaded!r} is not a class or factory function")
    return loaded


def _kind_ok(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str) and bool(value)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return callable(value)


def check_environment(env: Any, name: str) -> None:
    """Raise one GraftError listing everything ``env`` lacks of the environment interface."""
    from stages.envs.prompts import STYLES

    problems = []
    for attr, kind in ENV_ATTRIBUTES.items():
        if not hasattr(env, attr):
            problems.append(f"{attr}{'()' if kind == 'method' else ''} is missing")
        elif not _kind_ok(getattr(env, attr), kind):
            problems.append(f"{attr} = {getattr(env, attr)!r} is not a {kind}")
    style = getattr(env, "prompt_style", None)
    if isinstance(style, str) and style and style not in STYLES:
        problems.append(f"prompt_style '{style}' is not one of {', '.join(STYLES)}")
    if not problems:
        game = env.new_game()
        problems += [f"new_game() returns a game without {m}()" for m in GAME_METHODS if not hasattr(game, m)]
    if problems:
        raise GraftError(
            f"env.name '{name}': {type(env).__name__} does not implement the environment interface "
            f"(stages/envs/base.py): {'; '.join(problems)} ({GUIDE})"
        )
