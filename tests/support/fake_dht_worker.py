"""A stand-in DHT worker for unit tests of the client's pipe handling (no hivemind).

    python tests/support/fake_dht_worker.py

Speaks dht/wire.py like dht/worker.py. Its hello names the port it was given (for 0, one of its
own). A store is acknowledged; "maddrs" names the worker's pid (so a test sees a restart); a get
misbehaves as its key says: "huge:N" (a reply of N bytes, past the client's limit), "garbage" (a
body that is not msgpack), "scalar" (a body that is not a map), "die" (exits at once), "unframe"
(a length prefix past what a reader may skip: the pipe loses its framing while the process lives
on), "many:N" (N small entries), "child" (starts a process that outlives the worker, as
hivemind's p2pd may: its pid is the entry's value); any other key has one entry.
"""

import os
import struct
import subprocess
import sys
import time

from fusionllm.dht.wire import read_message, read_tagged, write_message


def _get(out, tag: int, key: str) -> None:
    if key.startswith("huge:"):
        write_message(out, {"ok": True, "items": [["s", bytes(int(key[5:])), 1.0]]}, tag=tag)
    elif key == "garbage":
        out.write(struct.pack(">IQ", 1, tag) + b"\xc1")  # 0xc1: never valid msgpack
    elif key == "scalar":
        write_message(out, 7, tag=tag)
    elif key == "die":
        os._exit(3)
    elif key == "unframe":
        out.write(struct.pack(">IQ", 0xFFFFFFFF, tag))
        time.sleep(120)  # alive, but its pipe is useless: the client must kill it
    elif key == "child":
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        write_message(out, {"ok": True, "items": [["child", child.pid, 1.0]]}, tag=tag)
    elif key.startswith("many:"):
        items = [[f"s{i}", b"v", float(i)] for i in range(int(key[5:]))]
        write_message(out, {"ok": True, "items": items}, tag=tag)
    else:
        write_message(out, {"ok": True, "items": [["s", key.encode(), 1.0]]}, tag=tag)


def main() -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    inp = sys.stdin.buffer
    config = read_message(inp)
    mode = "client" if config.get("client_mode") else "server"
    # The port it was given, or one of its own for 0 (a restart that keeps it shows).
    port = int(config["listen"].rsplit("/", 1)[1]) or 20000 + os.getpid() % 20000
    write_message(
        out, {"ok": True, "peer_id": "FakePeer", "maddrs": [f"/ip4/127.0.0.1/tcp/{port}"]}
    )
    while True:
        tag, message = read_tagged(inp)
        op = message.get("op")
        if op == "stop":
            return
        if op == "store":
            write_message(out, {"ok": True, "stored": True}, tag=tag)
        elif op == "maddrs":
            write_message(out, {"ok": True, "maddrs": [f"/pid/{os.getpid()}", f"/{mode}"]}, tag=tag)
        elif op == "get":
            _get(out, tag, message["key"])


if __name__ == "__main__":
    main()
