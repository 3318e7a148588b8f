"""Where the loop's rollout stage runs beyond the driver process (SPEC §12, docs/scaling.md).

``cluster.executor = "local"`` (the default) plays an iteration's groups in the loop's own process;
``"ray"`` spreads them over a pool of Ray actors, one ``--shard i/n`` share each
(``stages.cluster.ray_executor.RayRolloutPool``, actors built from ``stages.cluster.worker``). The
credit stages, the update and the evaluation stay in the driver either way.

``ray`` is an optional extra (``pip install -e '.[ray]'``): nothing here imports it; the pool's module
does, and only the ray executor loads that module.
"""

from __future__ import annotations

import importlib.util
import socket

from schemas.config import Config
from schemas.errors import GraftError

CONNECT_TIMEOUT_S = 5.0  # an address where nothing listens is refused now, not after Ray's retries


def ray_installed() -> bool:
    """Whether the ``ray`` package can be imported (without importing it: that takes seconds)."""
    return importlib.util.find_spec("ray") is not None


def check_executor(config: Config) -> None:
    """A GraftError when ``cluster.executor`` names an executor this machine cannot start: ray not
    installed, or nothing listening at a ``cluster.address`` of the form HOST:PORT."""
    if config.cluster.executor != "ray":
        return
    if not ray_installed():
        raise GraftError(
            "cluster.executor = 'ray' (--executor ray) but ray is not installed "
            "(pip install -e '.[ray]' in the graft checkout, or use --executor local)"
        )
    if config.cluster.address not in ("", "auto"):
        probe_address(config.cluster.address)


def probe_address(address: str) -> None:
    """A GraftError naming ``cluster.address`` when nothing accepts a TCP connection at HOST:PORT (Ray
    itself keeps retrying an unreachable head for minutes before it gives up)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise GraftError(
            f"cluster.address = {address!r}: no Ray head answers there ({exc.strerror or exc}); start one "
            "with `ray start --head` or use cluster.address = '' for a local Ray"
        ) from None
