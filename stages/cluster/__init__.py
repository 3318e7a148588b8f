"""Where the loop's rollout stage runs beyond the driver process (docs/design.md §12, docs/scaling.md).

``cluster.executor = "local"`` (the default) plays an iteration's groups in the loop's own process;
``"ray"`` spreads them over a pool of Ray actors, one ``--shard i/n`` share each
(``stages.cluster.ray_executor.RayRolloutPool``, actors built from ``stages.cluster.worker``). The
credit stages, the update and the evaluation stay in the driver either way.

``ray`` is an optional extra (``pip install -e '.[ray]'``): nothing here imports it; the pool's module
does, and only the ray executor loads that module.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket

from schemas.config import Config
from schemas.errors import GraftError

CONNECT_TIMEOUT_S = 5.0  # an address where nothing listens is refused now, not after Ray's retries
REPLY_TIMEOUT_S = 3.0  # a Ray head (gRPC) answers the HTTP/2 greeting at once
# HTTP/2's client connection preface followed by an empty SETTINGS frame: a gRPC server (Ray's GCS, or
# the Ray Client server behind ray://) answers with a SETTINGS frame of its own
_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS_FRAME = 4
_HOST_PORT = re.compile(r"(ray://)?([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):\d{1,5}")


def ray_installed() -> bool:
    """Whether the ``ray`` package can be imported (without importing it: that takes seconds)."""
    return importlib.util.find_spec("ray") is not None


def joined_address(address: str) -> tuple[str, str] | None:
    """(address, where it comes from) of the Ray cluster ``ray.init`` would join for
    ``cluster.address``: the address itself, or with '' / 'auto' the ``RAY_ADDRESS`` environment
    variable (which ray.init reads then); None when it starts (or finds) a local Ray."""
    if address not in ("", "auto"):
        return address, f"cluster.address = {address!r}"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if _HOST_PORT.fullmatch(env):
        return env, f"RAY_ADDRESS = {env!r} (where ray.init connects with cluster.address = {address!r})"
    return None


def check_executor(config: Config) -> None:
    """A GraftError when ``cluster.executor`` names an executor this machine cannot start: ray not
    installed, or no Ray head at the address ray.init would join (``probe_address``)."""
    if config.cluster.executor != "ray":
        return
    if not ray_installed():
        raise GraftError(
            "cluster.executor = 'ray' (--executor ray) but ray is not installed "
            "(pip install -e '.[ray]' in the graft checkout, or use --executor local)"
        )
    joined = joined_address(config.cluster.address)
    if joined is not None:
        probe_address(*joined)


def probe_address(address: str, source: str | None = None) -> None:
    """A GraftError naming ``source`` (default: cluster.address) when no Ray head answers at HOST:PORT:
    nothing accepts a TCP connection, or what does accept does not answer HTTP/2's greeting as Ray's
    gRPC servers do within seconds. ray.init itself would keep retrying such an address for ever."""
    source = source or f"cluster.address = {address!r}"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    fix = "start one with `ray start --head`, or use cluster.address = '' for a local Ray"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S) as conn:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.sendall(_HTTP2_GREETING)
            reply = _read(conn, 9)
    except TimeoutError:  # accepted, and silent
        reply = b""
    except OSError as exc:
        raise GraftError(f"{source}: no Ray head answers there ({exc.strerror or exc}); {fix}") from None
    if len(reply) < 9 or reply[3] != _SETTINGS_FRAME:
        raise GraftError(f"{source}: something accepts connections there, but it is not a Ray head; {fix}")


def _read(conn: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes (fewer when the peer closes first)."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data
