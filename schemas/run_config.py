"""The run's config.toml is sealed by the run's manifest.

Every time graft writes a run's ``config.toml`` (a new run, ``graft loop --force`` with another config,
a new ``--iters`` target) it keeps the same text in the run's ``manifest.json`` under ``config``
(``write_run_config``). A ``config.toml`` that differs from that text in anything an iteration computes
with -- a hand edit of the estimator, the seed, ``model.tiny_hidden`` -- is a config change like one
given with ``--set``: every command that reads the run's config refuses it (``refuse_config_edit``)
until ``graft loop --run RUN --force`` accepts it, which seals the new text and appends the changed
keys to the manifest's ``config_changes``. The keys that are not config changes (``run.iters``,
``[checkpoint]``, ``[log]``, ``[cluster]``, docs/loop.md) may be edited freely.

A kill between the two writes is safe: the new text is recorded as ``config_pending`` first, then
config.toml is replaced, then the seal; a config.toml equal to either is what graft wrote.
A run from before the seal (a manifest without ``config``) is sealed by the next ``graft loop``.
"""

from __future__ import annotations

import copy
import json
import tomllib
import warnings
from typing import Any

from schemas.atomic import atomic_write_text
from schemas.config import Config, config_from_dict, load_config
from schemas.errors import GraftError
from schemas.manifest import MANIFEST_FILE, ensure_run_manifest, iteration_finished, run_manifest
from schemas.rundir import Run

CONFIG_KEY = "config"  # config.toml's text as graft last wrote it
PENDING_KEY = "config_pending"  # the text being written (between the manifest and config.toml)
CHANGES_KEY = "config_changes"  # accepted changes: the changed keys and the iterations finished before


def comparable(config: Config) -> dict[str, Any]:
    """``config`` as a dict without the keys that never change an iteration's tables (the loop's
    stopping point, checkpoint retention, live logging, the executor)."""
    data = copy.deepcopy(config.to_dict())
    data["run"].pop("iters", None)
    for section in ("checkpoint", "log", "cluster"):
        data.pop(section, None)
    return data


def changed_keys(old: Config, new: Config) -> list[str]:
    """``section.key: old -> new`` for every key of ``comparable`` that differs."""
    a, b = comparable(old), comparable(new)
    changes = []
    for section in sorted(set(a) | set(b)):
        left, right = a.get(section, {}), b.get(section, {})
        for key in sorted(set(left) | set(right)):
            if left.get(key) != right.get(key):
                changes.append(f"{section}.{key}: {left.get(key)!r} -> {right.get(key)!r}")
    return changes


def _parse(text: str) -> Config | None:
    try:
        with warnings.catch_warnings():  # a warning about the sealed text was given when it was written
            warnings.simplefilter("ignore")
            return config_from_dict(tomllib.loads(text), "sealed config")
    except (tomllib.TOMLDecodeError, GraftError):
        return None


def _sealed_texts(data: dict[str, Any] | None) -> list[str]:
    if data is None:
        return []
    return [data[key] for key in (CONFIG_KEY, PENDING_KEY) if isinstance(data.get(key), str)]


def config_edit(run: Run) -> list[str] | None:
    """The keys ``config.toml`` changes against the text the run's manifest seals (None: it is what graft
    wrote, differs only in keys that are not config changes, or the run has no seal yet)."""
    sealed = _sealed_texts(run_manifest(run))
    if not sealed or not run.config_path.is_file():
        return None
    text = run.config_path.read_bytes().decode("utf-8", "replace")
    if text in sealed:
        return None
    current = load_config(run.config_path)  # an unreadable edit is its own one-line error
    best: list[str] | None = None
    for sealed_text in sealed:
        old = _parse(sealed_text)
        changes = changed_keys(old, current) if old is not None else ["(the sealed config is unreadable)"]
        if not changes:
            return None
        best = changes if best is None or len(changes) < len(best) else best
    return best


def refuse_config_edit(run: Run, accept: bool = False) -> None:
    """GraftError (one line naming config.toml and the changed keys) when config.toml was edited since
    graft sealed it; ``accept`` (``graft loop --force``): the caller seals it (``write_run_config``)."""
    changes = config_edit(run)
    if changes is None or accept:
        return
    shown = "; ".join(changes[:4]) + (" ..." if len(changes) > 4 else "")
    raise GraftError(
        f"{run.config_path}: differs from the config the run's {MANIFEST_FILE} seals ({shown}); a changed "
        f"config is refused: restore it, or continue with it: graft loop --run {run.root} --force"
    )


def write_run_config(run: Run, config: Config) -> None:
    """Write ``config`` as the run's config.toml and seal it in the run's manifest (under the run's
    lock); an accepted change of keys an iteration computes with is appended to ``config_changes``."""
    text = config.to_toml()
    data = ensure_run_manifest(run)
    current = run.config_path.read_text() if run.config_path.is_file() else None
    if data.get(CONFIG_KEY) == text and current == text and PENDING_KEY not in data:
        return
    manifest_path = run.root / MANIFEST_FILE
    data[PENDING_KEY] = text
    atomic_write_text(manifest_path, json.dumps(data, indent=2, sort_keys=True))
    if current != text:
        atomic_write_text(run.config_path, text)
    old_text = data.get(CONFIG_KEY)
    old = _parse(old_text) if isinstance(old_text, str) else None
    changes = changed_keys(old, config) if old is not None else []
    if changes:
        finished = [i for i in run.iterations() if iteration_finished(run, i)]
        history = data.get(CHANGES_KEY) if isinstance(data.get(CHANGES_KEY), list) else []
        data[CHANGES_KEY] = [*history, {"after_iterations": finished, "changed": changes}]
    data[CONFIG_KEY] = text
    data.pop(PENDING_KEY, None)
    atomic_write_text(manifest_path, json.dumps(data, indent=2, sort_keys=True))
