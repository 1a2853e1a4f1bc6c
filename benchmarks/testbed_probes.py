"""What the nodes' bandwidth probe reads on emulated links, against what the links carry.

    sudo python benchmarks/testbed_probes.py [--rounds 5] [--json PATH]

For each row, two testbed hosts (fusionllm.testbed) joined by one link as the row says; one
runs a bare ControlHost (py-libp2p, noise + yamux: the probe's real path), the other probes
it --rounds times at 64 KiB (the test swarms' size) and 1 MiB (the default), 0.5 s apart on
one connection. Printed: the medians of the probe's figure (``probe_bandwidth``: its bytes
over first byte to ack, less one RTT), of the raw figure (bytes over first byte to ack) and
of the RTT, beside the configured cap and round trip. No training runs meanwhile: this is
the probe alone, on a machine otherwise as loaded as it is.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from fusionllm.node.children import JsonChild
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import parse_topology

SIZES = (64 << 10, 1 << 20)
# (row, one-way delay ms, rate Mbit/s)
ROWS = [
    ("20 Mbit/s, 40 ms", 20.0, 20.0),
    ("100 Mbit/s, 40 ms", 20.0, 100.0),
    ("100 Mbit/s, 100 ms", 50.0, 100.0),
    ("1 Gbit/s, 1 ms", 0.5, 1000.0),
    ("8 Mbit/s, 80 ms", 40.0, 8.0),
]


def _host(key: str, addr: str, probe_bytes: int):
    from fusionllm.node.p2p.control_host import ControlConfig, ControlHost

    config = ControlConfig(
        key_path=Path(key), listen_host=addr, probe_bytes=probe_bytes, probe_timeout_s=60.0,
        max_probes_served_per_peer_per_min=10**6,
    )  # fmt: skip
    return ControlHost(config).start()


def serve(key: str, addr: str) -> None:
    host = _host(key, addr, 1 << 20)
    print(json.dumps({"event": "ready", "addr": host.listen_addrs[0]}), flush=True)
    sys.stdin.read()  # until the parent closes it
    host.close()


def probe(key: str, addr: str, target: str, rounds: int) -> None:
    host = _host(key, addr, max(SIZES))
    peer = host.connect(target)
    results = []
    for _ in range(rounds):
        for size in SIZES:
            r = host.probe(peer, nbytes=size)
            raw = r.bytes / r.seconds
            results.append({"bytes": size, "probe": r.bandwidth, "raw": raw, "rtt": r.rtt})
            time.sleep(0.5)  # idle, as between a node's probe rounds
    print(json.dumps({"event": "probes", "results": results}), flush=True)
    host.close()


def _row(name: str, delay_ms: float, rate: float, rounds: int, workdir: str) -> list[dict]:
    link = {"hosts": ["a", "b"], "delay_ms": delay_ms, "rate_mbps": rate}
    topo = {"name": "pair", "hosts": [{"name": "a"}, {"name": "b"}], "links": [link]}
    me = [sys.executable, str(Path(__file__).resolve())]
    with Testbed(parse_topology(topo)) as bed:
        server_argv = [*me, "--serve", f"{workdir}/b.key", bed.address("b")]
        with JsonChild(bed.command("b", server_argv), stdin=True, name="server") as server:
            target = server.next_event(60)["addr"]
            done = bed.run(
                "a", [*me, "--probe", f"{workdir}/a.key", bed.address("a"), target,
                      str(rounds)], timeout=600,
            )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"prober failed: {done.stderr[-2000:]}")
    results = json.loads(done.stdout.splitlines()[-1])["results"]
    rows = []
    for size in SIZES:
        mine = [r for r in results if r["bytes"] == size]
        rows.append({
            "row": name, "cap_mb_s": rate / 8, "rtt_ms": 2 * delay_ms, "probe_kib": size >> 10,
            "probe_mb_s": statistics.median(r["probe"] for r in mine) / 1e6,
            "raw_mb_s": statistics.median(r["raw"] for r in mine) / 1e6,
            "measured_rtt_ms": statistics.median(r["rtt"] for r in mine) * 1e3,
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="probes per size (%(default)s)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0
    if args.probe:
        probe(*args.probe[:3], int(args.probe[3]))
        return 0
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 1
    rows = []
    with TemporaryDirectory() as workdir:
        for name, delay_ms, rate in ROWS:
            rows += _row(name, delay_ms, rate, args.rounds, workdir)
            print(f"  done: {name}", file=sys.stderr, flush=True)
    print(f"{'link':20} {'probe':>6} {'cap MB/s':>9} {'probe':>7} {'raw':>7} {'rtt ms':>7}")
    for r in rows:
        print(f"{r['row']:20} {r['probe_kib']:>4}Ki {r['cap_mb_s']:9.2f} {r['probe_mb_s']:7.2f} "
              f"{r['raw_mb_s']:7.2f} {r['measured_rtt_ms']:7.1f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
