"""How a run names its Ray cluster (rlexp/cluster/ray_connect.py), without starting one: an
address nothing answers at, or that is no Ray address, is a config error before Ray is asked;
the address comes from `cluster.address`, then RAY_ADDRESS, then a local Ray. Joining a real
cluster by those names: tests/test_cluster.py."""

import pytest

from rlexp.errors import ConfigError


def test_nothing_listening_at_the_address_is_a_config_error_before_ray_is_asked():
    from rlexp.cluster.ray_connect import RayAddress, check_reachable
    from tests.ray_nodes import free_port

    port = free_port()
    nothing = rf"cluster.address=127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}"
    with pytest.raises(ConfigError, match=nothing):
        check_reachable(RayAddress.resolve(f"127.0.0.1:{port}"))
    with pytest.raises(ConfigError, match="not a Ray address"):
        check_reachable(RayAddress.resolve("head-node"))


def test_the_address_comes_from_the_config_then_ray_address_then_a_local_ray(monkeypatch):
    from rlexp.cluster.ray_connect import RayAddress

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert RayAddress.resolve("auto").address == "auto"
    joined = RayAddress.resolve(None)
    assert joined == RayAddress("10.0.0.1:6379", "RAY_ADDRESS=10.0.0.1:6379 (cluster.address=null)")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert RayAddress.resolve(None).address is None
    monkeypatch.delenv("RAY_ADDRESS")
    assert RayAddress.resolve(None).address is None
