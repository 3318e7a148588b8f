"""How often do graft's and the reference's action-parsing rules disagree on real responses?

    python -m bench.probes.parsing_rules RUN [RUN ...]

Reads every generate-mode turn of the runs' ``iter_*/steps.parquet`` (played under
``env.action_parsing = "graft"``, so the recorded ``valid`` is graft's verdict: an action was found
and it was admissible) and reads each response again with the ``reference`` rule
(``stages.envs.parser.parse_reference``: first span, think block required, CJK invalid, admissibility
left to the world). Each turn falls in one class (``CLASSES``); the share of each, per run and pooled,
is printed as a Markdown table for docs/results/. Not a test.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import polars as pl

from stages.envs.parser import parse_reference, parse_response

CLASSES = (
    "both valid, same action",
    "both valid, different action",  # first vs last <action> span, or whitespace inside the tags
    "graft valid, reference invalid",  # no think block, or CJK text
    "graft invalid, reference valid",  # well-formed but inadmissible: penalised by graft only
    "both invalid",
)


def classify(style: str, response: str, graft_valid: bool) -> str:
    """The class (one of ``CLASSES``) of one turn: ``graft_valid`` is graft's recorded verdict."""
    reference = parse_reference(response)
    reference_valid = reference.action is not None and reference.well_formed
    if graft_valid and reference_valid:
        graft_action = parse_response(style, response)
        same = graft_action == " ".join((reference.action or "").split())
        return CLASSES[0] if same else CLASSES[1]
    if graft_valid:
        return CLASSES[2]
    return CLASSES[3] if reference_valid else CLASSES[4]


def count_classes(style: str, turns: Iterable[tuple[str, bool]]) -> Counter[str]:
    """Turns (response, graft's validity) counted per class."""
    return Counter(classify(style, response, valid) for response, valid in turns)


def run_turns(run: Path) -> list[tuple[str, bool]]:
    """(response, valid) of every turn the run's iterations recorded, in iteration order."""
    turns: list[tuple[str, bool]] = []
    for steps in sorted(run.glob("iter_*/steps.parquet")):
        table = pl.read_parquet(steps, columns=["response", "valid"])
        turns.extend((str(r or ""), bool(v)) for r, v in table.iter_rows())
    return turns


def table(counts: dict[str, Counter[str]]) -> str:
    head = "| run | turns | " + " | ".join(CLASSES) + " |"
    lines = [head, "|---|---|" + "---|" * len(CLASSES)]
    for name, counter in counts.items():
        total = sum(counter.values())
        shares = " | ".join(f"{counter[c] / total:.3f} ({counter[c]})" if total else "-" for c in CLASSES)
        lines.append(f"| {name} | {total} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--style", default="alfworld", choices=("alfworld", "webshop"))
    args = parser.parse_args()
    counts = {str(run): count_classes(args.style, run_turns(run)) for run in args.runs}
    if len(counts) > 1:
        counts["all"] = sum(counts.values(), Counter())
    print(table(counts))


if __name__ == "__main__":
    main()
