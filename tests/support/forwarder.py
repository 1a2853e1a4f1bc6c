"""A TCP port forward on 127.0.0.1, as a router or ``docker run -p A:B`` makes one.

It listens first (so its port can be announced before the target exists), forwards to
``target`` once set, and counts the bytes it carried each way.
"""

import contextlib
import socket
import threading


class Forwarder:
    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.target: int | None = None
        self.connections = 0
        self.bytes_in = 0  # towards the target
        self.bytes_out = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.target is None:
                conn.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                conn.close()
                continue
            with self._lock:
                self.connections += 1
                self._sockets += [conn, upstream]
            for src, dst, inbound in ((conn, upstream, True), (upstream, conn, False)):
                thread = threading.Thread(target=self._pump, args=(src, dst, inbound), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket, inbound: bool) -> None:
        src.settimeout(None)
        dst.settimeout(None)
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
                with self._lock:
                    if inbound:
                        self.bytes_in += len(data)
                    else:
                        self.bytes_out += len(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> "Forwarder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
