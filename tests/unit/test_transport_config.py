"""Transport configuration and the identity key file (no network)."""

import os

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.errors import IdentityError
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.node.p2p.transport import TransportConfig


@pytest.mark.parametrize(
    "override",
    [
        {"listen_host": "localhost"},
        {"listen_port": 70000},
        {"dial_timeout_s": 0},
        {"read_timeout_s": float("inf")},
        {"write_timeout_s": float("nan")},
        {"idle_timeout_s": -1},
        {"max_frame_bytes": 10},
        {"max_frame_bytes": 2**32},
        {"max_in_flight": 0},
        {"inbox_size": 0},
        {"decode_in_thread_bytes": -1},
    ],
)
def test_config_refuses_bad_values(tmp_path, override):
    with pytest.raises(ConfigError, match=next(iter(override))):
        TransportConfig(key_path=tmp_path / "k", **override)


def test_config_defaults_listen_on_loopback(tmp_path):
    config = TransportConfig(key_path=str(tmp_path / "k"), idle_timeout_s=float("inf"))
    assert str(config.host_config().listen_multiaddr) == "/ip4/127.0.0.1/tcp/0"
    assert config.max_body_bytes == min(config.max_frame_bytes, config.limits.max_frame_bytes)


def test_identity_is_created_private_and_reused(tmp_path):
    path = tmp_path / "sub" / "node.key"
    first = peer_id_of(load_or_create_identity(path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert peer_id_of(load_or_create_identity(path)) == first
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left


def test_identity_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "node.key"
    load_or_create_identity(path)
    path.chmod(0o640)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(path)


def test_identity_that_is_not_a_key_is_refused(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(b"not a key")
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="not a libp2p private key"):
        load_or_create_identity(path)
