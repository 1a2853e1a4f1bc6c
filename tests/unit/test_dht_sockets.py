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


def test_prefixes_come_from_our_p2pd_command_lines_only():
    ours = sockets.new_prefix()
    lines = [
        ["/x/p2pd", "-b", f"-listen=/unix{ours}p2pd-Ab_9-x.sock", "-id=/k"],
        ["/x/p2pd", "-listen=/unix/tmp/hivemind-p2pd-Ab9.sock"],  # hivemind's own name: not ours
        ["/x/p2pd", "-listen=/unix/etc/hivemind-fl0123456789ab-p2pd-x.sock"],  # not in /tmp
        ["python", "-m", "fusionllm.dht.worker"],
        [f"-listen=/unix{ours}p2pd-other.sock"],  # the same prefix once
    ]
    assert sockets.prefixes_in(lines) == [ours]
    assert sockets.prefixes_in([]) == []
