"""What the nodes' bandwidth probe reads on emulated links, against what the links carry.

    sudo python -m benchmarks.testbed_probes [--rounds 5] [--json PATH]   # in the repo root

For each row, two testbed hosts (fusionllm.testbed) joined by one link as the row says; one
runs a bare ControlHost (py-libp2p, noise + yamux: the probe's real path), the other probes
it --rounds times at 64 KiB (the test swarms' size) and 1 MiB (the default), 0.5 s apart on
one connection. Printed: the probe's figure (``probe_bandwidth``: its bytes over first byte to
ack, less one RTT) of the first round, on a new connection (cold: TCP's window still small,
as for a node's probe after seconds of quiet; 64 KiB goes first, then 1 MiB), the median of
the other rounds (warm), the median RTT, beside the configured cap and round trip; then the
raw figure (bytes over first byte to ack) and the tail's (the payload's second half as the
server timed it, probes.py), cold / warm. No
training runs meanwhile: this is the probe alone, on a machine otherwise as loaded as it is.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import parse_topology
from tests.support.probe_main import probe_link

SIZES = (64 << 10, 1 << 20)
# (row, one-way delay ms, rate Mbit/s)
ROWS = [
    ("20 Mbit/s, 40 ms", 20.0, 20.0),
    ("100 Mbit/s, 40 ms", 20.0, 100.0),
    ("100 Mbit/s, 100 ms", 50.0, 100.0),
    ("1 Gbit/s, 1 ms", 0.5, 1000.0),
    ("8 Mbit/s, 80 ms", 40.0, 8.0),
]


def _row(name: str, delay_ms: float, rate: float, rounds: int, workdir: str) -> list[dict]:
    link = {"hosts": ["a", "b"], "delay_ms": delay_ms, "rate_mbps": rate}
    topo = {"name": "pair", "hosts": [{"name": "a"}, {"name": "b"}], "links": [link]}
    with Testbed(parse_topology(topo)) as bed:
        results = probe_link(bed, "a", "b", Path(workdir), rounds=rounds, sizes=list(SIZES))
    rows = []
    for size in SIZES:
        mine = [r for r in results if r["bytes"] == size]
        rows.append({
            "row": name, "cap_mb_s": rate / 8, "rtt_ms": 2 * delay_ms, "probe_kib": size >> 10,
            "cold_mb_s": mine[0]["bandwidth"] / 1e6,
            "warm_mb_s": statistics.median(r["bandwidth"] for r in mine[1:]) / 1e6,
            "measured_rtt_ms": statistics.median(r["rtt"] for r in mine) * 1e3,
            "raw_cold_mb_s": mine[0]["raw"] / 1e6,
            "raw_warm_mb_s": statistics.median(r["raw"] for r in mine[1:]) / 1e6,
            "tail_cold_mb_s": mine[0].get("tail", 0.0) / 1e6,
            "tail_warm_mb_s": statistics.median(r.get("tail", 0.0) for r in mine[1:]) / 1e6,
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="probes per size (%(default)s)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (one cold probe, the rest warm)")
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 1
    rows = []
    with TemporaryDirectory() as workdir:
        for name, delay_ms, rate in ROWS:
            rows += _row(name, delay_ms, rate, args.rounds, workdir)
            print(f"  done: {name}", file=sys.stderr, flush=True)
    print(f"{'link':20} {'probe':>6} {'cap MB/s':>9} {'cold':>7} {'warm':>7} {'rtt ms':>7} "
          f"{'raw c/w':>13} {'tail c/w':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['row']:20} {r['probe_kib']:>4}Ki {r['cap_mb_s']:9.2f} {r['cold_mb_s']:7.2f} "
              f"{r['warm_mb_s']:7.2f} {r['measured_rtt_ms']:7.1f} "
              f"{r['raw_cold_mb_s']:6.2f}/{r['raw_warm_mb_s']:<6.2f} "
              f"{r['tail_cold_mb_s']:6.2f}/{r['tail_warm_mb_s']:<6.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
