"""The damage fuzzer at size: ``python -m bench.damage --cases 300`` plays that many seeded cases (one
random damage to a finished micro run, then one reader or writer; tests/helpers/damage_fuzz.py) and
writes the counts to docs/results/damage-fuzz.md: cases run, refused, identical, and the failures that
must stay at 0 (lost, silent wrong, escape, crash), with every failing case listed. The test suite runs
a fast sample of the same cases (tests/schemas/test_damage_fuzz.py)."""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.section_writer import RESULTS, write_section

RESULT_FILE = RESULTS / "damage-fuzz.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="Seeded cases to play (seeds from --first).")
    parser.add_argument("--first", type=int, default=1000, help="First seed (the CI sample uses 0..15).")
    parser.add_argument(
        "--minutes", type=float, default=0, help="Stop after this many minutes (0: no limit)."
    )
    parser.add_argument("--no-write", action="store_true", help="Print the counts only.")
    args = parser.parse_args()

    import torch

    import stages  # noqa: F401 - first: hides a torch extension built for another torch
    from tests.helpers import damage_fuzz as fuzz
    from tests.helpers.loop_runs import micro_run

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="graft-damage-fuzz-"))
    os.environ["GRAFT_CACHE_DIR"] = str(work / "cache")
    started = time.monotonic()
    try:
        reference = micro_run(work / "reference-run")
        other = fuzz.other_run(reference, work)
        answers: dict = {}
        counts: collections.Counter[str] = collections.Counter()
        by_damage: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        by_command: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        failures = []
        for seed in range(args.first, args.first + args.cases):
            if args.minutes and time.monotonic() - started > args.minutes * 60:
                break
            case = fuzz.draw_case(seed, reference)
            outcome = fuzz.run_case(case, reference, other, work, answers)
            counts[outcome.kind] += 1
            by_damage[case.damage][outcome.kind] += 1
            by_command[case.command][outcome.kind] += 1
            if outcome.kind in fuzz.FAILURES:
                failures.append(outcome)
            print(
                f"{seed} {case.damage} {case.target} | {case.command}: {outcome.kind} {outcome.why[:120]}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    minutes = (time.monotonic() - started) / 60
    body = _report(counts, by_damage, by_command, failures, minutes, args.first)
    print(body)
    if not args.no_write:
        write_section(RESULT_FILE, "Damage fuzzer", body)


def _table(title: str, rows: dict[str, collections.Counter[str]], kinds: list[str]) -> list[str]:
    lines = [f"| {title} | cases | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
    for name in sorted(rows):
        row = rows[name]
        lines.append(f"| {name} | {sum(row.values())} | " + " | ".join(str(row[k]) for k in kinds) + " |")
    return lines


def _report(counts, by_damage, by_command, failures, minutes: float, first: int) -> str:  # type: ignore[no-untyped-def]
    from tests.helpers.damage_fuzz import FAILURES

    total = sum(counts.values())
    kinds = ["refused", "identical", *FAILURES]
    lines = [
        f"{total} cases (seeds {first}..{first + total - 1}) in {minutes:.1f} min on the 2-iteration micro run "
        "(tests/helpers/loop_runs.py), each a fresh copy with one damage, then one command.",
        "",
        f"**cases run {total} · refused {counts['refused']} · identical {counts['identical']} · "
        f"lost {counts['lost']} · silent wrong {counts['silent wrong']} · escapes {counts['escape']} · "
        f"crashes {counts['crash']}**",
        "",
        "refused: exit 2 with one `error:` line and every file outside the damaged path unchanged; "
        "identical: exit 0 with the undamaged run's printed answer, tables and checkpoints (the damaged "
        "path aside, for a writer that did not read it); lost: a refusal that changed another file; silent "
        "wrong: exit 0 with other results; escape: a file outside the run changed; crash: any other exit.",
        "",
        *_table("damage", by_damage, kinds),
        "",
        *_table("command", by_command, kinds),
    ]
    if failures:
        lines += ["", "Failing cases:", ""]
        lines += [
            f"- seed {o.case.seed}: {o.case.damage} `{o.case.target}` ({o.case.detail}) | "
            f"`{o.case.command}`: {o.kind}: {o.why[:200]}"
            for o in failures
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
