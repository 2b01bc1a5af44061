"""Joining Ray, as Ray users expect it, with an error in seconds where Ray would wait or hang.

Where a run's Ray comes from (`cluster.address`):

    null              RAY_ADDRESS when set (`ray job submit` sets it for its entrypoint, as
                      users do by hand), else a new local Ray that ends with the run
    auto              the cluster this node belongs to (`ray start` on this node)
    host:port         the cluster whose head's GCS listens there (`ray start --head --port`)
    ray://host:10001  a remote cluster through Ray Client

Ray clusters started by `ray start --head` use token authentication by default (Ray 2.52+):
a driver that names the address explicitly needs `RAY_AUTH_MODE=token` and the cluster's token
(`RAY_AUTH_TOKEN`, or the file `~/.ray/auth_token`), as every node of the cluster does.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from rlexp.errors import ConfigError

log = logging.getLogger(__name__)

REACH_TIMEOUT_S = 5.0  # a head that does not accept a TCP connection in this long is not there


@dataclass(frozen=True)
class RayAddress:
    """Where to join and who asked for it (`cluster.address=...` or `RAY_ADDRESS=...`), or
    `address=None`: start a local Ray."""

    address: str | None
    source: str

    @classmethod
    def resolve(cls, address: str | None) -> RayAddress:
        if address:
            return cls(address, f"cluster.address={address}")
        env = os.environ.get("RAY_ADDRESS")
        if env and env != "local":
            return cls(env, f"RAY_ADDRESS={env} (cluster.address=null)")
        return cls(None, "a local Ray")


def check_reachable(where: RayAddress) -> None:
    """A ConfigError in seconds when nothing listens at `where` (Ray itself retries for about
    a minute, then fails with a message about its GCS)."""
    if where.address in (None, "auto"):  # Ray answers "auto" at once when no cluster is found
        return
    host, _, port = where.address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{where.source}: not a Ray address; expected auto, host:port (the head's "
                          "GCS, `ray start --head --port`) or ray://host:port (Ray Client)")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"{where.source}: nothing answers at {host}:{port} within "
                          f"{REACH_TIMEOUT_S:g}s ({e}); is the cluster's head up (`ray status`)?") from e


def init(where: RayAddress, num_cpus: int | None, num_gpus: int | None) -> None:
    """`ray.init` for `where`; a cluster that cannot be joined is a ConfigError naming why."""
    import ray
    from ray.exceptions import AuthenticationError

    check_reachable(where)
    kwargs: dict[str, Any]
    if where.address is None:  # "local": a new Ray even where a `ray start` on this node says otherwise
        kwargs = {"address": "local", "num_cpus": num_cpus, "num_gpus": num_gpus, "include_dashboard": False}
    else:
        kwargs = {"address": where.address}
    if not str(kwargs["address"]).startswith("ray://"):  # Ray Client takes fewer arguments
        kwargs["logging_level"] = logging.WARNING
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        if isinstance(e.__cause__, AuthenticationError):
            raise ConfigError(f"{where.source}: the cluster refused this driver's token. Its nodes use "
                              "token authentication: set RAY_AUTH_MODE=token and the cluster's token "
                              "(RAY_AUTH_TOKEN, or ~/.ray/auth_token) as on its nodes") from e
        raise ConfigError(f"{where.source}: could not join the Ray cluster: {e}") from e


def describe(where: RayAddress) -> str:
    """One line: which cluster this run is on, and what it sees of it."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    total = ray.cluster_resources()
    seen = f"{len(nodes)} node(s), {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs"
    if where.address is None:
        return f"started a local Ray: {seen}"
    gcs = ray.get_runtime_context().gcs_address
    return f"joined the cluster at {gcs} ({where.source}): {seen}"
