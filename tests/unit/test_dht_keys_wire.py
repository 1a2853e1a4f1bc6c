"""dht/keys.py (key names) and dht/wire.py (length-prefixed msgpack on a pipe)."""

import io
import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.dht.keys import check_swarm_name, nodes_key, plans_key
from fusionllm.dht.wire import (
    MAX_MESSAGE_BYTES,
    MAX_SKIP_BYTES,
    MessageError,
    PipeClosedError,
    read_message,
    read_tagged,
    write_message,
)

# ----------------------------------------------------------------------------- keys


@pytest.mark.parametrize("name", ["a", "demo", "Swarm-1", "x.y_z", "0", "a" * 64, "a-", "9.9"])
def test_valid_swarm_names(name):
    assert check_swarm_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "-a", ".a", "_a", "a" * 65, "a/b", "a b", "a\n", "\na", "é", "a:b", None, 5, b"demo"],
)
def test_invalid_swarm_names(name):
    with pytest.raises(ConfigError, match="swarm name"):
        check_swarm_name(name)


def test_key_names():
    assert nodes_key("demo") == "fusionllm/demo/nodes"
    assert plans_key("demo", 0) == "fusionllm/demo/plans/0"
    assert plans_key("demo", 123456) == "fusionllm/demo/plans/123456"
    assert plans_key("demo", 1) != plans_key("demo", 2) != plans_key("other", 2)


@pytest.mark.parametrize("epoch", [-1, 1.0, "1", None, True, False])
def test_plans_key_rejects_bad_epoch(epoch):
    with pytest.raises(ConfigError, match="epoch"):
        plans_key("demo", epoch)


@pytest.mark.parametrize("swarm", ["", "a/b", "../x"])
def test_keys_reject_bad_swarm(swarm):
    with pytest.raises(ConfigError):
        nodes_key(swarm)
    with pytest.raises(ConfigError):
        plans_key(swarm, 1)


# ----------------------------------------------------------------------------- wire


_messages = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.text(max_size=30)
    | st.binary(max_size=30)
    | st.floats(allow_nan=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=16,
)


@given(messages=st.lists(_messages, max_size=5))
def test_round_trip(messages):
    stream = io.BytesIO()
    for message in messages:
        write_message(stream, message)
    stream.seek(0)
    assert [read_message(stream) for _ in messages] == messages
    with pytest.raises(PipeClosedError):
        read_message(stream)


def test_int_map_keys_survive():
    stream = io.BytesIO()
    write_message(stream, {1: "a", "b": [1, 2]})
    stream.seek(0)
    assert read_message(stream) == {1: "a", "b": [1, 2]}


def test_frame_layout():
    stream = io.BytesIO()
    write_message(stream, {"op": "get"})
    data = stream.getvalue()
    body = msgpack.packb({"op": "get"}, use_bin_type=True)
    assert data == struct.pack(">IQ", len(body), 0) + body


class Trickle(io.RawIOBase):
    """Hands out at most one byte per read, like a slow pipe."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._data.read(min(size, 1) if size > 0 else size)


def test_short_reads_are_reassembled():
    stream = io.BytesIO()
    write_message(stream, ["hello", b"\x00" * 10, 3])
    assert read_message(Trickle(stream.getvalue())) == ["hello", b"\x00" * 10, 3]


def test_empty_stream_is_closed():
    with pytest.raises(PipeClosedError, match="closed"):
        read_message(io.BytesIO(b""))


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, 10, 12, 13, 20])
def test_truncated_message(cut):
    stream = io.BytesIO()
    write_message(stream, {"payload": "x" * 20})
    with pytest.raises(PipeClosedError):
        read_message(io.BytesIO(stream.getvalue()[:cut]))


def test_oversize_prefix_skips_that_message_only():
    stream = io.BytesIO()
    stream.write(struct.pack(">IQ", MAX_MESSAGE_BYTES + 1, 9) + bytes(MAX_MESSAGE_BYTES + 1))
    write_message(stream, {"next": 1}, tag=10)
    stream.seek(0)
    with pytest.raises(MessageError, match="over") as refused:
        read_message(stream)
    assert refused.value.tag == 9
    assert read_tagged(stream) == (10, {"next": 1})


def test_prefix_past_the_skip_limit_is_a_broken_pipe():
    data = struct.pack(">IQ", MAX_SKIP_BYTES + 1, 1) + b"\x00" * 16
    with pytest.raises(PipeClosedError, match="bytes on the pipe"):
        read_message(io.BytesIO(data))
    with pytest.raises(PipeClosedError):
        read_message(io.BytesIO(b"\xff\xff\xff\xff"))
