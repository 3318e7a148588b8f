"""The damage fuzzer: one random damage to a finished run, then one reader or writer on it.

A case is (seed -> damage, command). The damage is one of: delete a file or folder, truncate a file,
flip a byte, replace a file or folder by a symlink (to another place inside the run, or to a copy
outside it), swap a folder with the same folder of another run, edit a key of config.toml, delete a
key of a manifest. The command is a reader (``sql``, ``report``, ``export``, ``eval``), the loop's
resume, or a stage command with or without ``--force``.

Each outcome is classified against the same command on the undamaged run:

- ``refused``: exit 2 with one ``error:`` line, and every file outside the damaged path unchanged;
- ``identical``: exit 0 and the run's tables, checkpoints and the command's output as for the
  undamaged run;
- ``lost``: a refusal that changed or removed a file outside the damaged path;
- ``silent wrong``: exit 0 with other results than the undamaged run's;
- ``escape``: anything written outside the run (the link's target, the other run);
- ``crash``: any other exit (a traceback, exit 1).

The last four must never happen. Used by tests/schemas/test_damage_fuzz.py (a fast sample) and by
``python -m bench.damage`` (hundreds of cases, counts in docs/results/damage-fuzz.md).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from typer.testing import CliRunner

from graft_cli.app import app

DAMAGES = (
    "delete",
    "truncate",
    "flip",
    "link inside",
    "link outside",
    "swap with another run",
    "edit config",
    "delete manifest key",
)
# {run}: the damaged run; {out}: a fresh folder outside it
COMMANDS: dict[str, list[str]] = {
    "sql": ["sql", "{run}", "SELECT iter, count(*) AS n, sum(reward) AS r FROM steps GROUP BY iter ORDER BY iter"],
    "sql advantages": ["sql", "{run}", "SELECT iter, round(sum(advantage), 9) AS a FROM advantages GROUP BY iter ORDER BY iter"],
    "report": ["report", "{run}", "-o", "{out}"],
    "export": ["export", "{run}", "--iter", "1", "-o", "{out}"],
    "eval": ["eval", "{run}", "--iter", "1", "--force"],
    "eval initial": ["eval", "{run}", "--checkpoint", "initial", "--force"],
    "loop resume": ["loop", "--run", "{run}", "--iters", "2"],
    "graph": ["graph", "{run}", "--iter", "1"],
    "graph --force": ["graph", "{run}", "--iter", "1", "--force", "--yes"],
    "solve --force": ["solve", "{run}", "--iter", "1", "--force", "--yes"],
    "advantage --force": ["advantage", "{run}", "--iter", "1", "--force", "--yes"],
    "update": ["update", "{run}", "--iter", "1"],
    "update --force": ["update", "{run}", "--iter", "1", "--force", "--yes"],
    "rollout --force": ["rollout", "{run}", "--iter", "1", "--force", "--yes", "--no-progress"],
}  # fmt: skip
# the cheap commands (no model loaded), for the CI sample
CHEAP = ("sql", "sql advantages", "graph", "update", "loop resume", "graph --force", "solve --force")
FAILURES = ("lost", "silent wrong", "escape", "crash")
CONFIG_EDITS = (
    ("seed = 0", "seed = 3"),
    ('estimator = "graft"', 'estimator = "grpo"'),
    ("tiny_hidden = 32", "tiny_hidden = 64"),
    ('action_parsing = "graft"', 'action_parsing = "reference"'),
    ("iters = 2", "iters = 5"),  # not a config change: may be edited freely
)


@dataclass
class Case:
    seed: int
    damage: str
    target: str  # path relative to the run
    command: str
    detail: str = ""


@dataclass
class Outcome:
    case: Case
    kind: str  # refused | identical | lost | silent wrong | escape | crash
    why: str = ""


@dataclass
class Places:
    """The folders one case uses: the damaged run, the other run, the outside folder, the output."""

    run: Path
    other: Path
    outside: Path
    out: Path
    extra: dict[str, Path] = field(default_factory=dict)


def _entries(root: Path) -> list[str]:
    """Files and folders of the run a damage may hit (the lock file aside)."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.name == ".lock" or path.is_symlink():
            continue
        out.append(rel)
    return out


def draw_case(seed: int, reference: Path, commands: tuple[str, ...] = tuple(COMMANDS)) -> Case:
    """The case of ``seed``: a damage, its target in the run, and a command."""
    rng = random.Random(seed)
    damage = rng.choice(DAMAGES)
    command = rng.choice(commands)
    entries = _entries(reference)
    files = [e for e in entries if (reference / e).is_file()]
    folders = [e for e in entries if (reference / e).is_dir()]
    if damage in ("truncate", "flip"):
        target = rng.choice(files)
    elif damage == "swap with another run":
        target = rng.choice([f for f in folders if f.count("/") <= 1])
    elif damage == "edit config":
        target = "config.toml"
    elif damage == "delete manifest key":
        target = rng.choice([e for e in files if e.endswith("manifest.json")])
    else:
        target = rng.choice(entries)
    return Case(seed, damage, target, command)


def apply_damage(case: Case, places: Places) -> str:
    """Damage ``places.run`` as ``case`` says; returns what was done (for the report)."""
    rng = random.Random(case.seed * 7919 + 1)
    path = places.run / case.target
    if case.damage == "delete":
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        return "deleted"
    if case.damage == "truncate":
        size = path.stat().st_size
        keep = rng.randrange(size) if size else 0
        with open(path, "r+b") as fh:
            fh.truncate(keep)
        return f"truncated to {keep} of {size} bytes"
    if case.damage == "flip":
        data = bytearray(path.read_bytes())
        if not data:
            path.write_bytes(b"x")
            return "empty file given a byte"
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"flipped a bit of byte {at}"
    if case.damage == "link inside":
        same_kind = [
            e for e in _entries(places.run)
            if e != case.target and not e.startswith(case.target + "/") and not case.target.startswith(e + "/")
            and (places.run / e).is_dir() == path.is_dir()
        ]  # fmt: skip
        if not same_kind:
            return "no other entry of its kind: left as it was"
        other = rng.choice(same_kind)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.symlink_to(places.run / other, target_is_directory=(places.run / other).is_dir())
        return f"replaced by a link to {other}"
    if case.damage == "link outside":
        copy = places.outside / "copy"
        if path.is_dir():
            shutil.copytree(path, copy)
            shutil.rmtree(path)
        else:
            shutil.copy2(path, copy)
            path.unlink()
        path.symlink_to(copy, target_is_directory=copy.is_dir())
        return "replaced by a link to a copy outside the run"
    if case.damage == "swap with another run":
        theirs = places.other / case.target
        if not theirs.exists():
            return "the other run has no such folder: left as it was"
        mine = places.outside / "swap"
        shutil.move(path, mine)
        shutil.move(theirs, path)
        shutil.move(mine, theirs)
        return "swapped with the other run's"
    if case.damage == "edit config":
        text = path.read_text()
        old, new = rng.choice(CONFIG_EDITS)
        pattern = rf"^{re.escape(old)}$"
        if not re.search(pattern, text, re.M):
            return f"{old!r} not in config.toml: left as it was"
        path.write_text(re.sub(pattern, new, text, count=1, flags=re.M))
        return f"{old} -> {new}"
    if case.damage == "delete manifest key":
        data = json.loads(path.read_text())
        key = rng.choice(sorted(data))
        del data[key]
        path.write_text(json.dumps(data, indent=2, sort_keys=True))
        return f"deleted key {key!r}"
    raise ValueError(case.damage)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) -> its sha256; a link -> its target."""
    out = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.name == ".lock":
            continue
        if path.is_symlink():
            out[rel] = "link:" + str(path.readlink())
        elif path.is_file():
            out[rel] = _bytes_digest(path)
    return out


def results(root: Path) -> dict[str, str]:
    """What a command computed into the run, comparable across runs: every table's rows (wall-clock
    metric rows aside) and every checkpoint's weights."""
    import polars as pl

    from tests.helpers.loop_runs import WALL_CLOCK

    out = {}
    for path in sorted(root.rglob("*.parquet")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        try:
            frame = pl.read_parquet(path)
        except Exception:  # noqa: BLE001 - a damaged table: compared by its bytes
            out[str(rel)] = "unreadable:" + _bytes_digest(path)
            continue
        if "name" in frame.columns:
            frame = frame.filter(~pl.col("name").str.contains(WALL_CLOCK))
        frame = frame.drop([c for c in frame.columns if "seconds" in c])
        out[str(rel)] = hashlib.sha256(json.dumps(frame.to_dicts(), default=str).encode()).hexdigest()
    for path in sorted(root.glob("checkpoints/*/*.safetensors")) + sorted(root.glob("model/*.safetensors")):
        out[str(path.relative_to(root))] = _bytes_digest(path)
    return out


def _bytes_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:  # a dangling link, a folder under a file's name
        return f"unreadable ({type(exc).__name__})"


def _output_digest(places: Places) -> dict[str, str]:
    """The command's own output folder: exported weights and tables compared by content, text files
    with the run's path written as {run} (a PNG's bytes carry no more than the tables drawn: its tables
    are what the report read)."""
    out = {}
    for key, digest in snapshot(places.out).items():
        path = places.out / key
        if key.endswith((".png", ".html", ".svg")):
            continue
        if key.endswith((".md", ".json", ".txt")):
            text = path.read_text(errors="replace").replace(str(places.run), "{run}")
            digest = hashlib.sha256(text.encode()).hexdigest()
        out[key] = digest
    return out


READERS = ("sql", "sql advantages", "report", "export")  # write nothing into the run


def _normalized(text: str, places: Places) -> str:
    """A command's printed answer without what a wall clock measures."""
    text = text.replace(str(places.run), "{run}").replace(str(places.out), "{out}")
    text = re.sub(r"\b(\w*seconds\w*|\w*_per_s\w*)=[^ ,]+", r"\1=#", text)
    text = re.sub(r"\beta \S+", "eta #", text)
    return re.sub(r"\d+(\.\d+)? ?s\b", "#s", text)


def run_command(command: str, places: Places) -> tuple[int, str]:
    args = [a.replace("{run}", str(places.run)).replace("{out}", str(places.out)) for a in COMMANDS[command]]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output


@dataclass
class Reference:
    """The undamaged run's answer to one command."""

    exit_code: int
    stdout: str
    results: dict[str, str]
    output: dict[str, str]


def reference_answer(command: str, places: Places) -> Reference:
    code, output = run_command(command, places)
    return Reference(code, _normalized(output, places), results(places.run), _output_digest(places))


def classify(
    case: Case,
    places: Places,
    before_run: dict[str, str],
    before_other: dict[str, str],
    before_outside: dict[str, str],
    code: int,
    output: str,
    reference: Reference,
) -> Outcome:
    """The outcome of one damaged case (see the module docstring)."""
    if snapshot(places.other) != before_other:
        return Outcome(case, "escape", "the other run changed")
    if snapshot(places.outside) != before_outside:
        return Outcome(case, "escape", "a file outside the run changed")
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("warning: ")]
    if code == 2:
        if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in output:
            return Outcome(case, "crash", f"exit 2 without one error line: {output[-300:]}")
        after = snapshot(places.run)
        damaged = case.target
        changed = sorted(
            k
            for k in set(before_run) | set(after)
            if before_run.get(k) != after.get(k) and k != damaged and not k.startswith(damaged + "/")
        )
        if changed:
            return Outcome(case, "lost", f"refused ({lines[0][:160]}) but changed {changed[:4]}")
        return Outcome(case, "refused", lines[0][:200])
    if code != 0:
        return Outcome(case, "crash", f"exit {code}: {output[-300:]}")
    if reference.exit_code != 0:
        return Outcome(case, "silent wrong", f"exit 0 where the undamaged run gives {reference.exit_code}")
    # a reader's answer is what it prints; a writer's what it leaves in the run (its lines name what it
    # removed, which depends on what the damage left)
    if case.command in READERS and _normalized(output, places) != reference.stdout:
        return Outcome(case, "silent wrong", "printed another answer than the undamaged run")
    if case.command in READERS:
        if snapshot(places.run) != before_run:
            return Outcome(case, "lost", "a reader changed the run")
    else:  # what the writer left in the run; under the damaged path only what the writer wrote
        mine, theirs, after = results(places.run), reference.results, snapshot(places.run)

        def judged(key: str) -> bool:
            damaged = key == case.target or key.startswith(case.target + "/")
            return not damaged or after.get(key) != before_run.get(key)

        wrong = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k) and judged(k))
        if wrong:
            return Outcome(case, "silent wrong", f"results differ: {wrong[:4]}")
    if _output_digest(places) != reference.output:
        return Outcome(case, "silent wrong", "its output folder differs")
    return Outcome(case, "identical")


def fresh_places(reference: Path, other: Path, work: Path, name: str) -> Places:
    """Copies of the finished run and of the other run, with an empty outside folder, under ``work``."""
    base = work / name
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    places = Places(base / "run", base / "other", base / "outside", base / "out")
    shutil.copytree(reference, places.run, symlinks=True)
    shutil.copytree(other, places.other, symlinks=True)
    places.outside.mkdir()
    return places


def run_case(
    case: Case,
    reference: Path,
    other: Path,
    work: Path,
    answers: dict[str, Reference],
    on_reference: Callable[[str], None] | None = None,
) -> Outcome:
    """Damage a fresh copy of ``reference`` as ``case`` says, run its command, classify the outcome."""
    if case.command not in answers:  # the undamaged run's answer, once per command
        clean = fresh_places(reference, other, work, "reference")
        answers[case.command] = reference_answer(case.command, clean)
        if on_reference is not None:
            on_reference(case.command)
        shutil.rmtree(work / "reference")
    places = fresh_places(reference, other, work, "case")
    case.detail = apply_damage(case, places)
    before = (snapshot(places.run), snapshot(places.other), snapshot(places.outside))
    code, output = run_command(case.command, places)
    outcome = classify(case, places, *before, code, output, answers[case.command])
    shutil.rmtree(work / "case", ignore_errors=True)
    return outcome


def other_run(reference: Path, work: Path) -> Path:
    """Another finished run of the same shape: the micro run again with another seed."""
    from schemas.config import load_config
    from schemas.rundir import create_run
    from stages.loop import run_loop
    from tests.helpers.loop_runs import CONFIGS, MICRO

    config = load_config(CONFIGS / "quickstart.toml", [*MICRO, "run.seed=1"])
    run = create_run(work / "other", config)
    run_loop(run, config, config.run.iters)
    return run.root
