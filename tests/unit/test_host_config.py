"""HostConfig validation, and the configs that take their host fields from it (no network)."""

import dataclasses
import math
from pathlib import Path

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.control.node_config import NodeConfig
from fusionllm.node.p2p.control_host import ControlConfig
from fusionllm.node.p2p.peer_host import HostConfig
from fusionllm.node.p2p.transport import TransportConfig

KEY = Path("/nonexistent/key")


def test_defaults_listen_on_a_free_loopback_port():
    config = HostConfig(key_path=str(KEY))  # type: ignore[arg-type]
    assert config.key_path == KEY
    assert str(config.listen_multiaddr) == "/ip4/127.0.0.1/tcp/0"
    assert (config.dial_timeout_s, config.close_timeout_s) == (5.0, 5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.listen_port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        HostConfig(KEY)  # type: ignore[misc]


def test_ipv6():
    config = HostConfig(key_path=KEY, listen_host="::1", listen_port=4001)
    assert str(config.listen_multiaddr) == "/ip6/::1/tcp/4001"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("listen_host", "localhost"),
        ("listen_host", ""),
        ("listen_port", -1),
        ("listen_port", 65536),
        ("listen_port", 1.5),
        ("listen_port", True),
        ("dial_timeout_s", 0),
        ("dial_timeout_s", math.inf),
        ("close_timeout_s", math.nan),
        ("close_timeout_s", True),
    ],
)
def test_bad_values_are_config_errors_naming_the_field(name, value):
    with pytest.raises(ConfigError, match=name):
        HostConfig(key_path=KEY, **{name: value})


@pytest.mark.parametrize("config_type", [ControlConfig, TransportConfig])
def test_component_configs_check_their_host_fields_through_host_config(config_type):
    config = config_type(key_path=KEY, listen_port=4001, dial_timeout_s=2.0, close_timeout_s=1.0)
    assert config.host_config() == HostConfig(
        key_path=KEY, listen_port=4001, dial_timeout_s=2.0, close_timeout_s=1.0
    )
    with pytest.raises(ConfigError, match="listen_port"):
        config_type(key_path=KEY, listen_port=True)


def node_config(**overrides) -> NodeConfig:
    return NodeConfig(key_path=KEY, **overrides)


def test_node_config_builds_the_host_and_control_configs():
    config = node_config(listen_host="10.0.0.2", control_port=4001, probe_bytes=64 << 10)
    assert config.host_config() == HostConfig(
        key_path=KEY, listen_host="10.0.0.2", listen_port=4001
    )
    control = config.control_config()
    assert (control.listen_port, control.probe_bytes) == (4001, 64 << 10)
    assert control.host_config() == config.host_config()


def test_node_config_takes_the_probe_size_range_from_the_control_plane():
    largest = ControlConfig(key_path=KEY).max_probe_bytes
    assert node_config(probe_bytes=largest).probe_bytes == largest
    # Once accepted here (up to 64 MiB) and refused only when the daemon started.
    for bad in (largest + 1, 64 << 20, 0):
        with pytest.raises(ConfigError, match="probe_bytes"):
            node_config(probe_bytes=bad)


@pytest.mark.parametrize(
    ("name", "value"), [("listen_host", "example.com"), ("control_port", 70000)]
)
def test_node_config_refuses_a_bad_host_at_config_time(name, value):
    with pytest.raises(ConfigError, match="listen_host" if name == "listen_host" else "port"):
        node_config(**{name: value})


def test_node_config_hands_its_lane_options_to_the_data_plane():
    config = node_config(listen_host="10.0.0.2", lane_port=4002, lanes=False)
    transport = config.transport_config()
    assert (transport.listen_host, transport.lane_port, transport.lanes) == (
        "10.0.0.2",
        4002,
        False,
    )
    assert node_config().transport_config().lanes is True
    for bad in ({"lane_port": 70000}, {"lane_port": -1}, {"lanes": "yes"}):
        with pytest.raises(ConfigError, match="lane"):
            node_config(**bad)
