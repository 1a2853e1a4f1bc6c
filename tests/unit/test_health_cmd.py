"""``fusionllm health`` against listeners on 127.0.0.1 that greet, stay silent, or lie."""

import socket
import threading

import pytest

from fusionllm.node.cli.health_cmd import MULTISTREAM_HEADER, HealthError, check_libp2p_port
from fusionllm.node.cli.main import main


class Listener:
    """Accepts connections and sends ``greeting`` in ``pieces`` (or nothing) to each."""

    def __init__(self, greeting: bytes, pieces: int = 1):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.greeting, self.pieces = greeting, pieces
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            step = max(1, len(self.greeting) // self.pieces)
            for start in range(0, len(self.greeting), step):
                conn.sendall(self.greeting[start : start + step])
            self.done.wait(10)  # keep it open (silent) until the test is over

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def listener(request):
    made = Listener(*request.param)
    yield made
    made.close()


@pytest.mark.parametrize(
    "listener", [(MULTISTREAM_HEADER, 1), (MULTISTREAM_HEADER, 7)], indirect=True
)
def test_a_greeting_in_one_or_many_pieces_is_healthy(listener):
    took = check_libp2p_port("127.0.0.1", listener.port, timeout_s=5)
    assert 0 <= took < 5


@pytest.mark.parametrize("listener", [(b"", 1)], indirect=True)
def test_a_port_that_accepts_and_stays_silent_is_a_hung_node(listener):
    with pytest.raises(HealthError, match=r"sent no libp2p greeting in 0\.3 s"):
        check_libp2p_port("127.0.0.1", listener.port, timeout_s=0.3)


@pytest.mark.parametrize("listener", [(b"HTTP/1.1 400 Bad Request\r\n\r\n", 1)], indirect=True)
def test_another_protocol_is_not_the_node(listener):
    with pytest.raises(HealthError, match="not libp2p's greeting"):
        check_libp2p_port("127.0.0.1", listener.port, timeout_s=5)


def test_a_closed_port_cannot_be_reached():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # free once closed
    with pytest.raises(HealthError, match=f"127.0.0.1:{port} cannot be reached"):
        check_libp2p_port("127.0.0.1", port, timeout_s=5)


def test_a_port_out_of_range_is_refused():
    with pytest.raises(HealthError, match="port 70000 is not a TCP port"):
        check_libp2p_port("127.0.0.1", 70000, timeout_s=1)


@pytest.mark.parametrize("listener", [(MULTISTREAM_HEADER, 1)], indirect=True)
def test_the_command_exits_0_when_the_node_answers(listener, capsys):
    assert main(["health", "--port", str(listener.port)]) == 0
    assert f"control 127.0.0.1:{listener.port} answers" in capsys.readouterr().out


def test_the_command_exits_1_with_the_reason_when_it_does_not(capsys):
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    assert main(["health", "--port", str(port), "--timeout", "1"]) == 1
    assert f"fusionllm health: error: 127.0.0.1:{port} cannot be reached" in capsys.readouterr().err
