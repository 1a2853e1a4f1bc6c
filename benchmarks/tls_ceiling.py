"""What an encrypted channel outside py-libp2p could carry: TLS 1.3 (Python's ssl) vs raw TCP.

    python benchmarks/tls_ceiling.py [--rounds 20] [--json PATH]

Issue 13 measured the tensor transport's cost per frame inside py-libp2p's Python yamux and
noise (benchmarks/transport.py). This measures the ceiling of the alternative a fast data lane
would use: one TLS 1.3 connection per link (OpenSSL: AES-GCM or ChaCha20 in C), with the same
frame pattern as transport.py (8-byte length, payload, 1-byte answer), between two processes on
127.0.0.1, raw TCP the same way in the same run. No product code is measured here: it answers
"is the cost in encryption, or in the Python around it?".
"""

import argparse
import datetime
import json
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fusionllm.node.children import JsonChild

_MB = 1 << 20
_SIZES = {"64 KB": 64 << 10, "1 MB": _MB, "64 MB": 64 * _MB}


def _self_signed(workdir: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusionllm-bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = workdir / "cert.pem", workdir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _recv_into(conn, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], min(len(view) - got, 4 * _MB))
        if n == 0:
            return False
        got += n
    return True


def _server(tls: bool, cert: str, key: str) -> None:
    """Child: accept one connection, read length-prefixed frames into a buffer, answer each."""
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(cert, key)
        conn = context.wrap_socket(conn, server_side=True)
    buffer = bytearray(64 * _MB + 8)
    view = memoryview(buffer)
    while True:
        if not _recv_into(conn, view[:8]):
            return
        (size,) = struct.unpack(">Q", view[:8])
        if not _recv_into(conn, view[:size]):
            return
        conn.sendall(b"k")


def _bench(tls: bool, cert: Path, key: Path, rounds: int) -> dict[str, dict[str, float]]:
    argv = [sys.executable, __file__, "--server", "tls" if tls else "tcp", str(cert), str(key)]
    with JsonChild(argv, name="tls-server" if tls else "tcp-server") as child:
        port = int(child.next_event(30.0))
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.load_verify_locations(cert)
            context.check_hostname = False
            conn = context.wrap_socket(conn)
        results = {}
        for label, size in _SIZES.items():
            payload = bytes(size)
            frame = struct.pack(">Q", size)
            times = []
            for i in range(rounds + 1):
                started = time.perf_counter()
                conn.sendall(frame)
                conn.sendall(payload)
                if conn.recv(1) != b"k":
                    raise RuntimeError("the receiver went away")
                if i:  # the first round warms buffers and the congestion window
                    times.append(time.perf_counter() - started)
            results[label] = {"mb_s": size / statistics.median(times) / 1e6}
        conn.close()
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--server", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.server:
        _server(args.server[0] == "tls", args.server[1], args.server[2])
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        cert, key = _self_signed(Path(workdir))
        raw = _bench(False, cert, key, args.rounds)
        tls = _bench(True, cert, key, args.rounds)
    print(f"one frame at a time, answered; MB/s (1e6 B), medians of {args.rounds}, 127.0.0.1")
    print(f"{'size':>6} {'raw TCP':>9} {'TLS 1.3':>9} {'TLS/raw':>8}")
    for label in _SIZES:
        ratio = tls[label]["mb_s"] / raw[label]["mb_s"]
        print(f"{label:>6} {raw[label]['mb_s']:>9.0f} {tls[label]['mb_s']:>9.0f} {ratio:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"raw_tcp": raw, "tls13": tls}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
