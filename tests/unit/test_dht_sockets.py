"""dht/sockets.py: a worker's socket prefix is its own, and only sockets carrying it go."""

import os
import socket

import pytest

from fusionllm.dht import sockets


def _listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    return s


def test_prefixes_are_fresh_and_checked():
    a, b = sockets.new_prefix(), sockets.new_prefix()
    assert a != b
    assert sockets.check_prefix(a) == a
    for bad in ("/tmp/hivemind-", "/tmp/hivemind-fl*-", "/tmp/../etc/hivemind-fl000000000000-",
                "/tmp/hivemind-flzzzzzzzzzzzz-", None):  # fmt: skip
        with pytest.raises(ValueError, match="not a DHT socket prefix"):
            sockets.check_prefix(bad)


def test_only_our_sockets_are_removed():
    ours, theirs = sockets.new_prefix(), sockets.new_prefix()
    made = [ours + "p2pd-abc.sock", ours + "p2pclient-abc.sock", theirs + "p2pd-abc.sock",
            "/tmp/hivemind-p2pd-" + theirs[-13:-1] + ".sock"]  # fmt: skip
    plain = ours + "p2pd-file.sock"  # a regular file with our name: not a socket, kept
    held = [_listen(p) for p in made]
    try:
        with open(plain, "w"):
            pass
        assert sorted(sockets.remove_sockets(ours)) == sorted(made[:2])
        assert [os.path.exists(p) for p in made] == [False, False, True, True]
        assert os.path.exists(plain)
        assert sockets.remove_sockets(ours) == []
    finally:
        for s in held:
            s.close()
        for p in [*made, plain]:
            if os.path.exists(p):
                os.remove(p)
