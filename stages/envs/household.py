"""``household``: procedurally generated ALFWorld-like tasks in one room (pure Python, fast).

The six task types carry ALFWorld's labels (pick_and_place_simple, look_at_obj_in_light,
pick_clean_then_place_in_recep, pick_heat_then_place_in_recep, pick_cool_then_place_in_recep,
pick_two_obj_and_place). The action grammar and the observation texts follow ALFWorld's TextWorld
grammar (``logic/alfred.twl2`` of the ALFWorld data): ``go to X``, ``open X``, ``close X``,
``take A from X``, ``put A in/on X`` (the literal "in/on", as in the twl2 grammar of the ALFWorld
data we ship for tests; ALFWorld 2.x's ``move A to X`` is not used), ``clean A with X`` (sinkbasin),
``heat A with X`` (microwave), ``cool A with X`` (fridge), ``use X`` (desklamp), ``look``,
``inventory``, ``examine X``. As in ALFWorld the agent holds at most one object, a closed receptacle
must be opened before its contents can be seen, taken or added to, and an action outside the
admissible list prints "Nothing happens." without changing the world.

``irreversible = true`` (not ALFWorld's rule; an option for credit-assignment benchmarks) makes one
kind of mistake final: putting an object of the goal's kind anywhere but a goal receptacle (for a
look-at-in-light task: anywhere) breaks it, and the episode ends at once, lost. Every other step
stays reversible, so a failed episode holds one decisive step among steps that were fine.

Reward: step reward 0; a won episode ends with outcome ``success_outcome`` = 10, anything else 0
(the Episode wrapper adds the invalid-action penalty).

Size knobs (environment options): ``receptacles`` (receptacles in the room), ``objects_per_type``
(instances of the goal object type; pick-two tasks get at least 2), ``distractors`` (other objects),
``shuffle`` (true: every task has its own room; false: all tasks share one room drawn from
``layout_seed`` and differ in their goal — the memorisable setting), ``task_types`` (a subset of the
six labels), ``info_actions`` (list ``look``/``inventory``/``examine`` among the admissible actions,
as ALFWorld does). A room always gets the appliances its task needs (all three and a desklamp when
``shuffle`` is false) plus at least two plain receptacles, so ``receptacles`` is a floor-bounded
target. The memorisable CPU setting is e.g. ``shuffle = false, receptacles = 5, distractors = 1``
(6 receptacles, 22 distinct train and 12 eval goals, expert solutions of 4–9 steps); the default (shuffled, 6
receptacles) gives 4–10 steps; ``receptacles = 16, distractors = 10, objects_per_type = 3`` is a
larger one.

The state key is the full world state (agent location, held object, open receptacles, lamp, every
object's place and clean/hot/cold state): the same world state always gives the same key, and two
states that print the same text but differ (e.g. a different object in hand) get different keys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from stages.envs.base import Observation, Task, Transition
from stages.envs.tasksets import build_task_list, check_options, check_task_types

ENV_NAME = "household"

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# receptacle type -> openable
RECEPTACLE_TYPES: dict[str, bool] = {
    "countertop": False,
    "cabinet": True,
    "drawer": True,
    "shelf": False,
    "diningtable": False,
    "sidetable": False,
    "desk": False,
    "dresser": False,
    "coffeetable": False,
    "sofa": False,
    "armchair": False,
    "bed": False,
    "garbagecan": False,
    "stoveburner": False,
    "toilet": False,
    "safe": True,
    "coffeemachine": False,
    "cart": False,
    "fridge": True,
    "microwave": True,
    "sinkbasin": False,
}
# the appliance each transformation needs, and the property it gives
APPLIANCE = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}
PROPERTY = {"clean": "clean", "heat": "hot", "cool": "cold"}
VERB = {"sinkbasin": "clean", "microwave": "heat", "fridge": "cool"}
LAMP_HOSTS = ("sidetable", "desk", "dresser")
LAMP = "desklamp 1"
PLAIN_RECEPTACLES = tuple(t for t in RECEPTACLE_TYPES if t not in APPLIANCE.values())
TARGET_TYPES = tuple(t for t in PLAIN_RECEPTACLES if t != "garbagecan")

# object type -> task capabilities (every type can be picked and placed)
OBJECT_TYPES: dict[str, frozenset[str]] = {
    name: frozenset(caps.split())
    for name, caps in {
        "apple": "clean heat cool",
        "tomato": "clean heat cool",
        "potato": "clean heat cool",
        "egg": "clean heat cool",
        "mug": "clean heat cool",
        "cup": "clean heat cool",
        "plate": "clean heat cool",
        "bowl": "clean heat cool look",
        "bread": "heat cool",
        "lettuce": "clean cool",
        "pan": "clean cool",
        "pot": "clean cool",
        "knife": "clean",
        "spoon": "clean",
        "fork": "clean",
        "spatula": "clean",
        "cloth": "clean",
        "soapbar": "clean",
        "sponge": "clean",
        "book": "look",
        "alarmclock": "look",
        "pen": "look",
        "pencil": "look",
        "cd": "look",
        "cellphone": "look",
        "keychain": "look",
        "creditcard": "look",
        "statue": "look",
        "vase": "look",
        "remotecontrol": "look",
        "watch": "look",
    }.items()
}
# what a task type needs from its goal object
NEEDS = {
    "pick_and_place_simple": None,
    "look_at_obj_in_light": "look",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": None,
}
GOAL_TEXTS = {
    "pick_and_place_simple": ("put a {o} in {t}", "put some {o} on {t}"),
    "look_at_obj_in_light": ("look at {o} under the desklamp", "examine the {o} with the desklamp"),
    "pick_clean_then_place_in_recep": ("put a clean {o} in {t}", "clean some {o} and put it in {t}"),
    "pick_heat_then_place_in_recep": ("put a hot {o} in {t}", "heat some {o} and put it in {t}"),
    "pick_cool_then_place_in_recep": ("put a cool {o} in {t}", "cool some {o} and put it in {t}"),
    "pick_two_obj_and_place": ("put two {o} in {t}", "find two {o} and put them in {t}"),
}

DEFAULTS: dict[str, Any] = {
    "receptacles": 6,
    "objects_per_type": 1,
    "distractors": 2,
    "shuffle": True,
    "layout_seed": 0,
    "task_types": list(TASK_TYPES),
    "info_actions": True,
    "irreversible": False,
}


def kind(name: str) -> str:
    """'apple 1' -> 'apple'."""
    return name.rsplit(" ", 1)[0]


def _a_list(items: list[str]) -> str:
    """ALFWorld's object list: 'nothing', 'a x 1', 'a x 1, and a y 2', 'a x 1, a y 2, and a z 1'."""
    if not items:
        return "nothing"
    phrases = [f"a {item}" for item in items]
    if len(phrases) == 1:
        return phrases[0]
    return ", ".join(phrases[:-1]) + ", and " + phrases[-1]


# ---------------------------------------------------------------------------------------------
# generation


def _receptacle_names(types: list[str]) -> list[str]:
    counts: dict[str, int] = {}
    names = []
    for t in types:
        counts[t] = counts.get(t, 0) + 1
        names.append(f"{t} {counts[t]}")
    return names


def _make_room(
    rng: random.Random, appliances: list[str], lamp: bool, n_receptacles: int, min_plain: int
) -> tuple[list[str], str | None]:
    """Receptacle names (sorted like ALFWorld's room description) and the lamp host, if any."""
    types = list(appliances)
    if lamp:
        types.append(rng.choice(LAMP_HOSTS))
    n_plain = max(n_receptacles - len(types), min_plain)
    # the first two plain receptacles have distinct non-garbage types so a target and a start exist
    first = rng.sample([t for t in TARGET_TYPES if t not in types], 2)
    types += first
    for _ in range(n_plain - 2):
        types.append(rng.choice(["cabinet", "drawer", "countertop", *PLAIN_RECEPTACLES]))
    names = sorted(_receptacle_names(types), key=lambda n: (kind(n), int(n.rsplit(" ", 1)[1])))
    host = None
    if lamp:
        host = next(n for n in names if kind(n) == types[len(appliances)])
    return names, host


def _object_names(type_counts: list[tuple[str, int]]) -> list[str]:
    counts: dict[str, int] = {}
    names = []
    for t, n in type_counts:
        for _ in range(n):
            counts[t] = counts.get(t, 0) + 1
            names.append(f"{t} {counts[t]}")
    return names


def _goal_text(rng: random.Random, task_type: str, obj: str, target: str | None) -> str:
    return rng.choice(GOAL_TEXTS[task_type]).format(o=obj, t=target)


def _spec(
    task_type: str,
    obj: str,
    target: str | None,
    text: str,
    receptacles: list[str],
    objects: list[list[str]],
    lamp_host: str | None,
) -> dict[str, Any]:
    need = NEEDS[task_type]
    return {
        "task_type": task_type,
        "text": text,
        "goal": {
            "object": obj,
            "target": target,
            "property": PROPERTY.get(need or ""),
            "count": 2 if task_type == "pick_two_obj_and_place" else 1,
            "light": task_type == "look_at_obj_in_light",
        },
        "receptacles": receptacles,
        "openable": [r for r in receptacles if RECEPTACLE_TYPES[kind(r)]],
        "objects": objects,  # [name, receptacle] in a fixed order
        "lamp": [LAMP, lamp_host] if lamp_host else None,
    }


def _shuffled_candidate(task_type: str, rng: random.Random, opts: dict[str, Any]) -> dict[str, Any]:
    """A task with its own room."""
    need = NEEDS[task_type]
    obj = rng.choice(sorted(o for o, caps in OBJECT_TYPES.items() if need is None or need in caps))
    appliances = [APPLIANCE[need]] if need in APPLIANCE else []
    light = task_type == "look_at_obj_in_light"
    receptacles, host = _make_room(rng, appliances, light, opts["receptacles"], min_plain=2)
    plain = [r for r in receptacles if kind(r) in TARGET_TYPES and r != host]
    target = None if light else rng.choice(sorted({kind(r) for r in plain}))
    starts = [r for r in receptacles if kind(r) != target and kind(r) not in appliances]
    n_goal = max(opts["objects_per_type"], 2 if task_type == "pick_two_obj_and_place" else 1)
    others = sorted(o for o in OBJECT_TYPES if o != obj)
    distractor_types = [rng.choice(others) for _ in range(opts["distractors"])]
    counts = [(obj, n_goal)] + [(t, 1) for t in distractor_types]
    names = _object_names(counts)
    placed = [[n, rng.choice(starts if kind(n) == obj else receptacles)] for n in names]
    placed.sort(key=lambda p: (receptacles.index(p[1]), p[0]))
    return _spec(task_type, obj, target, _goal_text(rng, task_type, obj, target), receptacles, placed, host)


def _fixed_room(opts: dict[str, Any]) -> dict[str, Any]:
    """The one room all tasks share when ``shuffle`` is false (needs every appliance and a lamp)."""
    rng = random.Random(f"household-room-{opts['layout_seed']}")
    receptacles, host = _make_room(rng, ["fridge", "microwave", "sinkbasin"], True, opts["receptacles"], 2)
    food = rng.choice(sorted(o for o, c in OBJECT_TYPES.items() if {"clean", "heat", "cool"} <= c))
    lookable = rng.choice(sorted(o for o, c in OBJECT_TYPES.items() if "look" in c and o != food))
    others = sorted(o for o in OBJECT_TYPES if o not in (food, lookable))
    n_goal = max(opts["objects_per_type"], 2)
    counts = [(food, n_goal), (lookable, n_goal)] + [
        (rng.choice(others), 1) for _ in range(opts["distractors"])
    ]
    names = _object_names(counts)
    plain = [r for r in receptacles if kind(r) in PLAIN_RECEPTACLES]
    placed = [[n, rng.choice(plain if kind(n) in (food, lookable) else receptacles)] for n in names]
    placed.sort(key=lambda p: (receptacles.index(p[1]), p[0]))
    return {"receptacles": receptacles, "lamp_host": host, "objects": placed}


def _fixed_candidate(task_type: str, rng: random.Random, room: dict[str, Any]) -> dict[str, Any] | None:
    """A goal in the shared room, or None when this type has no valid goal there."""
    need = NEEDS[task_type]
    receptacles, objects = room["receptacles"], room["objects"]
    count = 2 if task_type == "pick_two_obj_and_place" else 1
    by_type: dict[str, list[str]] = {}
    for name, where in objects:
        by_type.setdefault(kind(name), []).append(where)
    choices = []
    for obj, wheres in sorted(by_type.items()):
        if len(wheres) < count or (need is not None and need not in OBJECT_TYPES[obj]):
            continue
        if task_type == "look_at_obj_in_light":
            choices.append((obj, None))
            continue
        for target in sorted({kind(r) for r in receptacles if kind(r) in TARGET_TYPES}):
            if all(kind(w) != target for w in wheres):  # not already done at reset
                choices.append((obj, target))
    if not choices:
        return None
    obj, target = rng.choice(choices)
    text = _goal_text(rng, task_type, obj, target)
    return _spec(task_type, obj, target, text, receptacles, objects, room["lamp_host"])


# ---------------------------------------------------------------------------------------------
# the game


@dataclass
class _World:
    location: str | None = None  # None = the middle of the room
    held: str | None = None
    where: dict[str, str | None] = field(default_factory=dict)  # object -> receptacle (None = held)
    props: dict[str, set[str]] = field(default_factory=dict)
    opened: set[str] = field(default_factory=set)
    lamp_on: bool = False


class HouseholdGame:
    """One episode of a household task."""

    def __init__(self, info_actions: bool = True, irreversible: bool = False) -> None:
        self.info_actions = info_actions
        self.irreversible = irreversible
        self.spec: dict[str, Any] = {}
        self.world = _World()
        self.won = False
        self.broken: str | None = None  # the goal object a final mistake broke (``irreversible``)

    # -- reset / step ---------------------------------------------------------------------------
    def reset(self, task: Task) -> Observation:
        spec = task.spec
        self.spec = spec
        self.goal = spec["goal"]
        self.receptacles: list[str] = spec["receptacles"]
        self.openable = set(spec["openable"])
        self.object_order = [name for name, _ in spec["objects"]]
        self.lamp_host = spec["lamp"][1] if spec["lamp"] else None
        self.world = _World(
            where={name: where for name, where in spec["objects"]},
            props={name: set() for name, _ in spec["objects"]},
        )
        self.won = False
        self.broken = None
        text = (
            "-= Welcome to TextWorld, ALFRED! =-\n\n"
            + self._look_text()
            + f"\n\nYour task is to: {spec['text']}."
        )
        return self._observation(text)

    def step(self, action: str) -> Transition:
        action = action.strip().lower()
        if self.won or self.broken or action not in self.admissible():
            text = "Nothing happens."
        else:
            text = self._apply(action)
            self.won = self._goal_met()
        return Transition(
            observation=self._observation(text),
            reward=0.0,
            terminated=self.won or self.broken is not None,
            won=self.won,
            score=1.0 if self.won else 0.0,
            outcome=10.0 if self.won else 0.0,
        )

    # -- world rules --------------------------------------------------------------------------
    def _visible(self, r: str) -> bool:
        return r not in self.openable or r in self.world.opened

    def _contents(self, r: str) -> list[str]:
        items = [o for o in self.object_order if self.world.where[o] == r]
        if r == self.lamp_host:
            items.append(LAMP)
        return items

    def _describe(self, r: str) -> str:
        if r in self.openable:
            if r not in self.world.opened:
                return f"The {r} is closed."
            return f"The {r} is open. In it, you see {_a_list(self._contents(r))}."
        return f"On the {r}, you see {_a_list(self._contents(r))}."

    def _look_text(self) -> str:
        w = self.world
        if w.location is None:
            return f"You are in the middle of a room. Looking quickly around you, you see {_a_list(self.receptacles)}."
        return f"You are facing the {w.location}. Next to it, you see nothing."

    def admissible(self) -> list[str]:
        """ALFWorld-style admissible commands of the current state (sorted)."""
        w = self.world
        acts = [f"go to {r}" for r in self.receptacles if r != w.location]
        if self.info_actions:
            acts += ["inventory", "look"]
            if w.held:
                acts.append(f"examine {w.held}")
        r = w.location
        if r is not None:
            if self.info_actions:
                acts.append(f"examine {r}")
            if r in self.openable:
                acts.append(f"close {r}" if r in w.opened else f"open {r}")
            if self._visible(r):
                if w.held is None:
                    acts += [f"take {o} from {r}" for o in self._contents(r) if o != LAMP]
                else:
                    acts.append(f"put {w.held} in/on {r}")
            if w.held is not None and kind(r) in VERB:
                acts.append(f"{VERB[kind(r)]} {w.held} with {r}")
            if r == self.lamp_host:
                acts.append(f"use {LAMP}")
        return sorted(acts)

    def _apply(self, action: str) -> str:
        w = self.world
        if action.startswith("go to "):
            w.location = action[6:]
            return f"You arrive at {w.location}. {self._describe(w.location)}"
        if action.startswith("open "):
            w.opened.add(w.location)  # type: ignore[arg-type]
            return f"You open the {w.location}. {self._describe(w.location)}"  # type: ignore[arg-type]
        if action.startswith("close "):
            w.opened.discard(w.location)  # type: ignore[arg-type]
            return f"You close the {w.location}."
        if action.startswith("take "):
            obj = action[5:].split(" from ", 1)[0]
            w.where[obj], w.held = None, obj
            return f"You pick up the {obj} from the {w.location}."
        if action.startswith("put "):
            obj = w.held
            w.where[obj], w.held = w.location, None  # type: ignore[index]
            if self._breaks(obj, w.location):  # type: ignore[arg-type]
                self.broken = obj
                return f"You put the {obj} in/on the {w.location}. The {obj} breaks."
            return f"You put the {obj} in/on the {w.location}."
        if action.startswith(("clean ", "heat ", "cool ")):
            verb = action.split(" ", 1)[0]
            props = w.props[w.held]  # type: ignore[index]
            if verb == "heat":
                props.discard("cold")
            if verb == "cool":
                props.discard("hot")
            props.add(PROPERTY[verb])
            return f"You {verb} the {w.held} using the {w.location}."
        if action.startswith("use "):
            w.lamp_on = not w.lamp_on
            return f"You turn {'on' if w.lamp_on else 'off'} the {LAMP}."
        if action == "inventory":
            return f"You are carrying: a {w.held}." if w.held else "You are not carrying anything."
        if action == "look":
            return self._look_text()
        if action.startswith("examine "):
            thing = action[8:]
            if thing == w.location:
                return self._describe(thing)
            props = w.props[thing]
            words = [
                word for prop, word in (("hot", "hot"), ("cold", "cool"), ("clean", "clean")) if prop in props
            ]
            if not words:
                return f"There's nothing special about {thing}."
            if words == ["cool"]:
                words = ["cold"]
            return f"This is a {' and '.join(words)} {kind(thing)}."
        raise AssertionError(f"unhandled admissible action {action!r}")

    def _breaks(self, obj: str, receptacle: str) -> bool:
        """``irreversible``: a goal-kind object put anywhere but a goal receptacle breaks."""
        if not self.irreversible or kind(obj) != self.goal["object"]:
            return False
        return self.goal["light"] or receptacle not in self._targets()

    def _goal_met(self) -> bool:
        g, w = self.goal, self.world
        if g["light"]:
            return (
                w.lamp_on
                and w.held is not None
                and kind(w.held) == g["object"]
                and w.location == self.lamp_host
            )
        return any(len(self._done_in(r)) >= g["count"] for r in self._targets())

    def _targets(self) -> list[str]:
        return [r for r in self.receptacles if kind(r) == self.goal["target"]]

    def _done_in(self, r: str) -> list[str]:
        """Goal objects in receptacle ``r`` that satisfy the goal's property."""
        g, w = self.goal, self.world
        return [
            o
            for o in self.object_order
            if w.where[o] == r
            and kind(o) == g["object"]
            and (g["property"] is None or g["property"] in w.props[o])
        ]

    # -- state and observation ----------------------------------------------------------------
    def state_key(self) -> str:
        w = self.world
        objects = ";".join(
            f"{o}@{w.where[o] or 'hand'}" + "".join(f"+{p}" for p in sorted(w.props[o]))
            for o in self.object_order
        )
        opened = ",".join(r for r in self.receptacles if r in w.opened)
        return (
            f"at={w.location or 'middle'}|hold={w.held or '-'}|open={opened}|"
            f"lamp={'on' if w.lamp_on else 'off'}|{objects}"
            + (f"|broken={self.broken}" if self.broken else "")
        )

    def _observation(self, text: str) -> Observation:
        return Observation(
            text=text, admissible=self.admissible(), state_key=self.state_key(), task_text=self.spec["text"]
        )

    def situation(self) -> str:
        """What the agent can tell of its situation from the prompt, in words the observations use:
        where it is and what it carries, e.g. ``at fridge 1 carrying apple 1``, ``at middle carrying
        nothing`` (the warm start's ``situation`` thinking text, docs/warmstart.md)."""
        w = self.world
        return f"at {w.location or 'middle'} carrying {w.held or 'nothing'}"

    # -- expert ---------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """A scripted expert with full knowledge of the room; replans from any state."""
        if self.won or self.broken:
            return None
        g, w = self.goal, self.world
        if w.held is not None and kind(w.held) != g["object"]:
            return self._drop()
        if g["light"]:
            if w.held is None:
                return self._fetch(next(o for o in self.object_order if kind(o) == g["object"]))
            if w.location != self.lamp_host:
                return f"go to {self.lamp_host}"
            return f"use {LAMP}"
        target = max(self._targets(), key=lambda r: len(self._done_in(r)))  # first of the best
        if w.held is None:
            done = set(self._done_in(target))
            todo = [o for o in self.object_order if kind(o) == g["object"] and o not in done]
            return self._fetch(todo[0])
        prop = g["property"]
        if prop is not None and prop not in w.props[w.held]:
            appliance = next(
                r for r in self.receptacles if VERB.get(kind(r)) and PROPERTY[VERB[kind(r)]] == prop
            )
            if w.location != appliance:
                return f"go to {appliance}"
            return f"{VERB[kind(appliance)]} {w.held} with {appliance}"
        return self._goto_open(target) or f"put {w.held} in/on {target}"

    def _goto_open(self, r: str) -> str | None:
        if self.world.location != r:
            return f"go to {r}"
        if not self._visible(r):
            return f"open {r}"
        return None

    def _fetch(self, obj: str) -> str:
        r = self.world.where[obj]
        return self._goto_open(r) or f"take {obj} from {r}"  # type: ignore[arg-type]

    def _drop(self) -> str:
        """Put a useless held object down somewhere (the nearest visible receptacle)."""
        r = self.world.location
        if r is None:
            r = next(x for x in self.receptacles if x not in self.openable)  # a room always has one
        return self._goto_open(r) or f"put {self.world.held} in/on {r}"


# ---------------------------------------------------------------------------------------------
# the environment


class HouseholdEnv:
    """Task sets and games of the household world."""

    name = ENV_NAME
    prompt_style = "alfworld"
    # tasks per split the tiny tokenizer plays by default: the rarely drawn object names need ~150
    # (fewer leave words out, docs/rollout.md); 300 household tasks take ~2 s
    vocab_tasks = 150
    success_outcome = 10.0

    def __init__(self, max_turns: int, invalid_penalty: float, options: dict[str, Any]) -> None:
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.options = options
        self._room = None if options["shuffle"] else _fixed_room(options)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        types = self.options["task_types"]

        def candidate(index: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
            for offset in range(len(types)):  # round robin over types; skip a type with no goal here
                task_type = types[(index + offset) % len(types)]
                if self._room is None:
                    return task_type, _shuffled_candidate(task_type, rng, self.options)
                spec = _fixed_candidate(task_type, rng, self._room)
                if spec is not None:
                    return task_type, spec
            raise AssertionError("the fixed room supports every task type")

        return build_task_list(ENV_NAME, split, count, seed, candidate)

    def new_game(self) -> HouseholdGame:
        return HouseholdGame(
            info_actions=self.options["info_actions"], irreversible=self.options["irreversible"]
        )

    def failure_outcome(self, score: float) -> float:
        return 0.0


def make_household(
    max_turns: int = 50, invalid_penalty: float = -0.1, data: str = "", **options: Any
) -> HouseholdEnv:
    """Factory for the registry (``data`` is unused: the world is generated)."""
    from schemas.errors import GraftError

    opts = check_options(ENV_NAME, options, DEFAULTS)
    check_task_types(ENV_NAME, opts["task_types"], TASK_TYPES)
    if opts["receptacles"] < 3 or opts["objects_per_type"] < 1 or opts["distractors"] < 0:
        raise GraftError(
            "environment 'household': need receptacles >= 3, objects_per_type >= 1, distractors >= 0"
        )
    return HouseholdEnv(max_turns, invalid_penalty, opts)
