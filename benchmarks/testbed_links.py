"""How true the emulated WAN is: configured round trips and caps against what sockets see.

    sudo python benchmarks/testbed_links.py [--seconds 6] [--json PATH]

For each row, a pair of testbed hosts (fusionllm.testbed) with one link configured as the
row says: TCP round trips of 64 bytes (median, p90 of 30), or one TCP stream for --seconds
(rate over all of it, and "steady" from 1 s after its first byte, past slow start), and the
emulator's CPU share meanwhile. The last row runs every ordered pair of topology C at once
(20 streams), the emulator's worst load here. Plain sockets, no fusionllm node: this
measures the emulator, nothing of the product.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

from fusionllm.testbed import paths
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import load_topology, parse_topology

# (row, one-way delay ms, rate Mbit/s or None, loss)
ROWS = [
    ("rtt 0.5 ms", 0.25, None, 0.0),
    ("rtt 20 ms", 10.0, None, 0.0),
    ("rtt 100 ms", 50.0, None, 0.0),
    ("8 Mbit/s, 40 ms", 20.0, 8.0, 0.0),
    ("10 Mbit/s, 20 ms", 10.0, 10.0, 0.0),
    ("100 Mbit/s, 20 ms", 10.0, 100.0, 0.0),
    ("100 Mbit/s, 100 ms", 50.0, 100.0, 0.0),
    ("uncapped, 0.5 ms", 0.25, None, 0.0),
    ("50 Mbit/s, 20 ms, 1% loss", 10.0, 50.0, 0.01),
]


def _pair(delay_ms: float, rate: float | None, loss: float) -> Testbed:
    link = {"hosts": ["a", "b"], "delay_ms": delay_ms, "loss": loss}
    if rate:
        link["rate_mbps"] = rate
    topo = {"name": "pair", "hosts": [{"name": "a"}, {"name": "b"}], "links": [link]}
    return Testbed(parse_topology(topo))


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _row(name: str, delay_ms: float, rate: float | None, loss: float, seconds: float) -> dict:
    with _pair(delay_ms, rate, loss) as bed:
        cpu0, t0 = _cpu(bed.emulator_pid), time.monotonic()
        row = {"row": name, "rtt_ms": 2 * delay_ms, "cap_mbps": rate, "loss": loss}
        if name.startswith("rtt"):
            rtts = sorted(paths.round_trips(bed, "a", "b", count=30))
            row |= {"median_ms": statistics.median(rtts), "p90_ms": rtts[int(0.9 * len(rtts))]}
        else:
            before = bed.emulator_stats()["fifos"]["link:a>b"]
            result = paths.stream(bed, "a", "b", seconds=seconds)
            after = bed.emulator_stats()["fifos"]["link:a>b"]
            lost = after["lost"] - before["lost"]
            sent = after["packets"] - before["packets"] + lost
            row |= {"mbps": result["mbps"], "steady_mbps": result["steady_mbps"],
                    "lost_share": lost / max(1, sent)}  # fmt: skip
        row["emulator_cpu"] = (_cpu(bed.emulator_pid) - cpu0) / (time.monotonic() - t0)
        row["realtime"] = bed.realtime
    return row


def _all_pairs(seconds: float) -> dict:
    """Every ordered pair of topology C streaming at once."""
    with Testbed(load_topology("C")) as bed:
        pairs = [(a, b) for a in bed.hosts for b in bed.hosts if a != b]
        results: dict = {}

        def one(a: str, b: str) -> None:
            results[(a, b)] = paths.stream(bed, a, b, seconds=seconds)

        threads = [threading.Thread(target=one, args=p) for p in pairs]
        cpu0, t0 = _cpu(bed.emulator_pid), time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        cpu = (_cpu(bed.emulator_pid) - cpu0) / (time.monotonic() - t0)
        total = sum(r["mbps"] for r in results.values())
    return {"row": f"topology C, {len(pairs)} streams", "mbps": total, "emulator_cpu": cpu}


def _print(rows: list[dict]) -> None:
    print(f"{'row':28} {'measured':>26} {'emulator CPU':>13}")
    for row in rows:
        if "median_ms" in row:
            what = f"median {row['median_ms']:.2f} p90 {row['p90_ms']:.2f} ms"
        else:
            steady = row.get("steady_mbps")
            what = f"{row['mbps']:.1f} Mbit/s" + (f" (steady {steady:.1f})" if steady else "")
            if row.get("loss"):
                what += f" lost {100 * row['lost_share']:.2f}%"
        print(f"{row['row']:28} {what:>26} {100 * row['emulator_cpu']:12.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per stream (%(default)s)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 1
    rows = []
    for spec in ROWS:
        rows.append(_row(*spec, seconds=args.seconds))
        print(f"  done: {rows[-1]['row']}", file=sys.stderr, flush=True)
    rows.append(_all_pairs(args.seconds))
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
