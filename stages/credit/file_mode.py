"""The credit stages on plain files (``graft graph|solve|advantage STEPS -o OUT``): what a folder of
file-mode tables was built from, and the chain that rebuilds only what is missing or stale.

``.credit_inputs.json`` in the output folder records what its tables were built from: the steps file
(path, size, mtime) and the ``[graph]`` config for nodes and edges, plus the ``[solve]`` config for
values. ``advantage_chain`` reuses tables only when they match, so a changed steps file or ``--set
graph.*`` / ``solve.*`` is never answered with stale tables; it runs the stages it has to in one
process and hands the frames on in memory (``ChainTables``), so each input is read once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from schemas.atomic import atomic_write_text
from schemas.config import Config
from schemas.jsonfile import load_json
from stages.credit.runners import ChainTables, advantage_files, graph_files, solve_files

INPUTS_FILE = ".credit_inputs.json"


def graph_inputs(steps: Path, config: Config) -> dict[str, Any]:
    """What nodes and edges built from ``steps`` with ``config`` depend on, in its stored form."""
    stat = steps.stat()
    key = {
        "steps": str(steps.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "graph": dataclasses.asdict(config.graph),
    }
    return json.loads(json.dumps(key))  # compare in the form it is stored in


def solve_inputs(config: Config) -> dict[str, Any]:
    """What values depend on beyond the graph: the ``[solve]`` section, in its stored form."""
    return json.loads(json.dumps(dataclasses.asdict(config.solve)))


def read_inputs(folder: Path) -> dict[str, Any]:
    """The folder's record of what its tables were built from ({} when none or unreadable)."""
    try:
        data = load_json(folder / INPUTS_FILE)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_inputs(folder: Path, inputs: dict[str, Any]) -> None:
    atomic_write_text(folder / INPUTS_FILE, json.dumps(inputs, sort_keys=True))


def graph_chain(steps: Path, folder: Path, config: Config) -> None:
    """``graft graph STEPS -o OUT``: nodes and edges, recorded as built from ``steps`` and ``config``
    (any values in the folder are stale from now on)."""
    graph_files(steps, folder, config, require_stamp=False)
    write_inputs(folder, {"graph": graph_inputs(steps, config)})


def solve_chain(folder: Path, config: Config) -> None:
    """``graft solve OUT``: values from the folder's nodes and edges, recorded beside the graph's record
    (a folder whose graph has no record keeps none: its values cannot be matched to a steps file)."""
    solve_files(folder, config)
    inputs = read_inputs(folder)
    if "graph" in inputs:
        write_inputs(folder, {"graph": inputs["graph"], "solve": solve_inputs(config)})


def advantage_chain(steps: Path, folder: Path, config: Config) -> None:
    """``graft advantage STEPS -o OUT``: the graph and values rebuilt when missing or stale (built from
    another steps file or another graph / solve config), then the advantages."""
    inputs = read_inputs(folder)
    wanted = graph_inputs(steps, config)
    have_graph = (folder / "nodes.parquet").is_file() and (folder / "edges.parquet").is_file()
    chain = ChainTables()  # one process: each table is read once and handed on in memory
    if not have_graph or inputs.get("graph") != wanted:
        graph_files(steps, folder, config, require_stamp=False, chain=chain)
        inputs = {"graph": wanted}
        write_inputs(folder, inputs)
    if not (folder / "values.parquet").is_file() or inputs.get("solve") != solve_inputs(config):
        solve_files(folder, config, steps_path=steps, chain=chain)
        write_inputs(folder, {"graph": wanted, "solve": solve_inputs(config)})
    advantage_files(steps, folder, config, require_stamp=False, chain=chain)
