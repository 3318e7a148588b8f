"""The quickstart needs only the ``train`` extra: nothing on its path imports the packages of the
``envs`` extra (textworld, alfworld, bm25s), whose install compiles Fast Downward."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO
ENVS_EXTRA = ("textworld", "alfworld", "bm25s")
MICRO = [
    "rollout.groups=1", "rollout.group_size=2", "env.max_turns=2", "env.train_tasks=1",
    "env.eval_tasks=1", "eval.group_size=1", "model.tiny_vocab_tasks=2", "model.tiny_hidden=16",
    "model.tiny_layers=1", "model.tiny_heads=2", "update.minibatch_size=8",
]  # fmt: skip
# ``sys.modules[name] = None`` makes ``import name`` fail as if the package were not installed
BLOCK_AND_RUN = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
sys.argv = ["graft", *{args!r}]
from graft_cli.app import main
try:
    main()
finally:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r} and sys.modules[m] is not None)
    print("loaded:", loaded)
"""


@pytest.mark.slow
def test_quickstart_runs_without_the_envs_extra(tmp_path: Path) -> None:
    args = ["loop", "--config", str(ROOT / "configs" / "quickstart.toml"), "--run", str(tmp_path / "r")]
    args += ["--iters", "1", *[a for s in MICRO for a in ("--set", s)]]
    code = BLOCK_AND_RUN.format(blocked=ENVS_EXTRA, args=args)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "iter    0" in done.stdout and "loaded: []" in done.stdout
    assert (tmp_path / "r" / "checkpoints" / "iter_0000").is_dir()


def test_the_train_extra_holds_no_envs_package() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    train = " ".join(extras["train"]).lower()
    assert not any(name in train for name in ENVS_EXTRA)
    assert all(any(name in dep for dep in extras["envs"]) for name in ENVS_EXTRA)
