"""The run's live engine is closed when the process ends, also when no loop closes it: a stage command
on its own (`graft rollout`, `graft eval`) would otherwise leave a vLLM engine's merged LoRA weights
(a full model) in the temp folder."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.paths import REPO

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import stages.policy.live_engine as live
    from schemas.config import Config

    marker = Path(sys.argv[1])

    class Engine:
        def load(self, model_dir, version):
            pass

        def close(self):
            marker.write_text(marker.read_text() + "closed\\n" if marker.exists() else "closed\\n")

    live.build_engine = lambda *args: Engine()
    live.live_engine(Config(), "model-a")
    live.live_engine(Config(), "model-b")  # the same engine, reloaded: still one close at exit
    if sys.argv[2] == "error":
        raise SystemExit(2)  # a command's one-line error ends the process this way
    """
)


def run_script(tmp_path: Path, ending: str) -> str:
    marker = tmp_path / f"closed-{ending}"
    subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker), ending], cwd=REPO, check=ending != "error", timeout=120
    )
    return marker.read_text() if marker.exists() else ""


def test_a_live_engine_is_closed_once_when_the_process_ends(tmp_path: Path) -> None:
    assert run_script(tmp_path, "normal") == "closed\n"


def test_a_live_engine_is_closed_when_a_command_exits_with_an_error(tmp_path: Path) -> None:
    assert run_script(tmp_path, "error") == "closed\n"
