"""The serving protocol's message checks and the session book's bounds (pure, no network)."""

import functools
import struct

import msgpack
import pytest
import trio

from fusionllm.common.errors import ConfigError
from fusionllm.node.serve import wire
from fusionllm.node.serve.api import OverloadedError
from fusionllm.node.serve.sessions import ServeLimits, SessionBook


class _Bytes:
    """A stream that hands out a fixed byte string, then ends."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


def _receive(data: bytes, **kw) -> dict:
    return trio.run(functools.partial(wire.receive, _Bytes(data), stall_timeout_s=1.0, **kw))


def test_a_message_round_trips():
    message = {"op": "step", "pos": 3, "t": b"\x00\x01"}
    assert _receive(wire.encode(message)) == message


@pytest.mark.parametrize("size", [0, 1025])
def test_a_length_outside_the_bound_is_refused_before_reading_the_body(size):
    with pytest.raises(wire.ServeWireError, match="not in"):
        _receive(struct.pack(">I", size), limit=1024)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # a byte msgpack never uses
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({1: "x"}, strict_types=False),  # a key that is not a str
        msgpack.packb({f"k{i}": i for i in range(17)}),  # more keys than any message has
        msgpack.packb({"t": list(range(17))}),  # an array longer than any field's
    ],
)
def test_malformed_bodies_are_typed_errors(body):
    with pytest.raises(wire.ServeWireError):
        wire.decode(body)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "must be int"),
        (True, "must be int"),
        (1.5, "must be int"),
        (-1, "not in"),
        (9, "not in"),
    ],
)
def test_field_checks_type_and_range(value, match):
    with pytest.raises(wire.ServeWireError, match=match):
        wire.field({"pos": value}, "pos", int, low=0, high=8)
    assert wire.field({"pos": 8}, "pos", int, low=0, high=8) == 8


def test_an_error_reply_is_bounded_in_size():
    reply = wire.error("BadRequest", "x" * 10_000)
    assert reply["ok"] is False
    assert len(reply["msg"]) == 300


@pytest.mark.parametrize(
    "kw", [{"max_sessions": 0}, {"max_cache_bytes": 1.5}, {"max_len": -1}, {"idle_s": 0}]
)
def test_limits_refuse_nonsense(kw):
    with pytest.raises(ConfigError):
        ServeLimits(**kw)


def test_the_book_bounds_sessions_and_cache_bytes_and_frees_on_release():
    book = SessionBook(ServeLimits(max_sessions=2, max_cache_bytes=100))
    book.admit(60)
    with pytest.raises(OverloadedError, match="passes the bound"):
        book.admit(41)
    assert (book.sessions, book.cache_bytes) == (1, 60)  # a refusal takes nothing
    book.admit(40)
    with pytest.raises(OverloadedError, match="sessions open"):
        book.admit(0)
    book.release(60)
    book.admit(60)
    assert (book.sessions, book.cache_bytes) == (2, 100)


def test_the_clients_throwaway_key_folder_is_gone_once_its_host_is_made(tmp_path, monkeypatch):
    from fusionllm.node.serve import client

    monkeypatch.setattr(client.tempfile, "tempdir", str(tmp_path))
    host = client._client_host(None)
    assert host.peer_id
    assert list(tmp_path.iterdir()) == []
