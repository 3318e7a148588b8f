"""Warm-start fixtures: a small household config whose warm start trains in seconds, and an independent
reading of the household's situation text from a state key."""

from __future__ import annotations

TINY_SFT = [
    "env.name=household",
    "env.max_turns=8",
    "env.train_tasks=4",
    "env.eval_tasks=4",
    'env.options={shuffle = false, receptacles = 3, distractors = 0, objects_per_type = 1, info_actions = false, task_types = ["pick_and_place_simple"]}',
    "model.tiny_hidden=32",
    "model.tiny_heads=2",
    "sft.enabled=true",
    "sft.episodes=16",
    "sft.epochs=16",
    "sft.lr=1e-2",
    "sft.batch_size=16",
    "rollout.mode=generate",
    "rollout.groups=4",
    "rollout.group_size=2",
    "rollout.max_new_tokens=16",
    "rollout.history=0",
]


def situation_from_state(state_key: str) -> str:
    """Independent reference: the situation text from the household state key ``at=...|hold=...|...``."""
    fields = dict(part.split("=", 1) for part in state_key.split("|")[:2])
    held = "nothing" if fields["hold"] == "-" else fields["hold"]
    return f"at {fields['at']} carrying {held}"
