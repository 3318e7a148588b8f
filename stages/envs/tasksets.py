"""Helpers shared by the built-in environments: option checking and deterministic task sets.

Task sets are deterministic lists drawn from one candidate stream per ``seed``; a candidate belongs to
split "eval" when the hash of its content falls in one fifth of the hash space, else to "train". The
two splits are therefore disjoint by construction (a task's content decides its split, not the order
in which it was drawn), for every seed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from schemas.errors import GraftError
from stages.envs.base import Task

SPLITS = ("train", "eval")
EVAL_SHARE = 5  # one candidate in EVAL_SHARE (by content hash) is an eval task


def check_options(env_name: str, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Merge ``given`` into ``defaults``; unknown keys or wrong types are a GraftError naming the key."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        valid = ", ".join(f"{k} (default {defaults[k]!r})" for k in sorted(defaults))
        raise GraftError(f"environment '{env_name}': unknown option '{unknown[0]}'; valid options: {valid}")
    merged = dict(defaults)
    for key, value in given.items():
        expected = type(defaults[key])
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise GraftError(
                f"environment '{env_name}': option '{key}' = {value!r} is invalid; expected {expected.__name__}"
            )
        merged[key] = value
    return merged


def check_task_types(env_name: str, task_types: list[str], valid: tuple[str, ...]) -> None:
    """A GraftError unless ``task_types`` (option ``task_types``) is a non-empty subset of ``valid``."""
    unknown = [t for t in task_types if t not in valid]
    if unknown or not task_types:
        raise GraftError(
            f"environment '{env_name}': option 'task_types' has {unknown or 'no types'}; valid: {', '.join(valid)}"
        )


def content_digest(spec: dict[str, Any]) -> str:
    """Stable hex digest of a JSON-able task spec."""
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def split_of(digest: str) -> str:
    """The split a task with this content digest belongs to."""
    return "eval" if int(digest[:8], 16) % EVAL_SHARE == 0 else "train"


def candidate_rng(env_name: str, seed: int, index: int) -> random.Random:
    """The random source of candidate ``index`` of the stream for ``seed`` (independent per candidate)."""
    salt = int.from_bytes(hashlib.sha1(env_name.encode()).digest()[:4], "little")
    state = np.random.SeedSequence([salt, int(seed), int(index)]).generate_state(2)
    return random.Random(int(state[0]) << 32 | int(state[1]))


def build_task_list(
    env_name: str,
    split: str,
    count: int,
    seed: int,
    make_candidate: Callable[[int, random.Random], tuple[str, dict[str, Any]]],
    max_candidates: int | None = None,
) -> list[Task]:
    """``count`` tasks of ``split``: distinct while the candidate space allows, then cycled.

    ``make_candidate(index, rng)`` returns (task_type, spec). The task id is the env name plus the
    spec's digest, so the same content always gets the same id.
    """
    if split not in SPLITS:
        raise GraftError(f"unknown split '{split}'; splits: {', '.join(SPLITS)}")
    if count < 0:
        raise GraftError(f"task count must be >= 0, got {count}")
    limit = max_candidates if max_candidates is not None else 200 * max(count, 1) + 1000
    patience = 2000  # candidates in a row without a new task: the space is exhausted
    tasks: list[Task] = []
    seen: set[str] = set()
    index = last_new = 0
    while len(tasks) < count and index < limit and index - last_new < patience:
        task_type, spec = make_candidate(index, candidate_rng(env_name, seed, index))
        index += 1
        digest = content_digest(spec)
        if split_of(digest) != split or digest in seen:
            continue
        seen.add(digest)
        last_new = index
        tasks.append(Task(task_id=f"{env_name}-{digest[:12]}", task_type=task_type, spec=spec))
    if not tasks and count > 0:
        raise GraftError(f"environment '{env_name}': no {split} task exists with these options")
    distinct = len(tasks)
    while len(tasks) < count:  # a small task space: repeat the distinct tasks in order
        tasks.append(tasks[len(tasks) % distinct])
    return tasks
