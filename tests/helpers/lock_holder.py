"""Hold a run's lock from another process (the way a running ``graft loop`` does) for lock tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# written independently of schemas.lock.run_lock: a plain flock on <run>/.lock in a child process
_HOLDER = """
import fcntl, sys
fh = open(sys.argv[1], "a")
fcntl.flock(fh, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@contextmanager
def lock_held_elsewhere(root: Path, shared: bool = False) -> Iterator[None]:
    """While the block runs, another process holds ``root/.lock``."""
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root / ".lock"), "shared" if shared else "exclusive"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield
    finally:
        proc.kill()
        proc.wait()


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), the lock file aside."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }
