"""Circuit relay v2 across the testbed's home routers: what a relayed stream carries against
a direct one on the same links, and what the relay's per-circuit data limit does.

    sudo python -m benchmarks.nat_relay [--mib 8] [--rounds 3] [--json PATH]

Each row is a fresh testbed (fusionllm.testbed): a public relay host, a listener behind a
cone router that reserves a slot on it, a dialer behind a symmetric router, every pair 20 ms
apart, the caps the row names. The dialer alternates a direct stream to the relay's host
and a stream through the relay to the listener (benchmarks/nat_relay_node.py); the table
gives the medians and their ratio, measured in the same run. The last row sets the relay's
per-circuit data limit below one transfer: py-libp2p resets the circuit's stream there.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from fusionllm.node.children import JsonChild
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import parse_topology

NODE = [sys.executable, "-m", "benchmarks.nat_relay_node"]
RELAY_PORT = 8000
_START_S = 60.0

# (row, cap Mbit/s on every link or None, the relay's data limit per circuit in MiB)
ROWS = [
    ("100 Mbit/s, 20 ms", 100.0, 1024),
    ("uncapped, 20 ms", None, 1024),
    ("relay data limit 4 MiB", 100.0, 4),
]


def _topology(rate: float | None) -> dict:
    defaults = {"delay_ms": 10.0, **({"rate_mbps": rate} if rate else {})}
    hosts = [{"name": "relay"}, {"name": "cone", "nat": "cone"},
             {"name": "sym", "nat": "symmetric"}]  # fmt: skip
    return {"name": "nat-relay", "defaults": defaults, "hosts": hosts}


def _row(name: str, rate: float | None, data_mib: int, args: argparse.Namespace) -> dict:
    with Testbed(parse_topology(_topology(rate))) as bed:
        relay_argv = [*NODE, "relay", str(RELAY_PORT), "--data-mib", str(data_mib)]
        quiet = {"stderr": subprocess.DEVNULL}  # py-libp2p's logs
        with JsonChild(bed.command("relay", relay_argv), name="relay", **quiet) as relay:
            relay_id = relay.next_event(_START_S)["peer_id"]
            addr = f"/ip4/{bed.wan_address('relay')}/tcp/{RELAY_PORT}/p2p/{relay_id}"
            with JsonChild(bed.command("cone", [*NODE, "listener", "8001", addr]),
                           name="listener", **quiet) as listener:  # fmt: skip
                listener_id = listener.next_event(_START_S)["peer_id"]
                reserved = listener.next_event(_START_S)["ok"]
                argv = [*NODE, "dialer", "8002", addr, listener_id, "--mib", str(args.mib),
                        "--rounds", str(args.rounds)]  # fmt: skip
                done = bed.run("sym", argv, timeout=_START_S + 300 * args.rounds)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    transfers = [e for e in events if e.get("event") == "transfer"]
    row = {"row": name, "cap_mbps": rate, "relay_data_mib": data_mib, "reserved": reserved,
           "transfers": transfers}  # fmt: skip
    for path in ("direct", "relayed"):
        rates = [t["mb_s"] for t in transfers if t["path"] == path and t["ok"]]
        row[f"{path}_mb_s"] = statistics.median(rates) if rates else None
        row[f"{path}_failed"] = sorted({t["error"] for t in transfers
                                        if t["path"] == path and not t["ok"]})  # fmt: skip
    if row["direct_mb_s"] and row["relayed_mb_s"]:
        row["ratio"] = row["relayed_mb_s"] / row["direct_mb_s"]
    if not transfers:
        row["error"] = done.stderr[-2000:]
    return row


def _print(rows: list[dict], mib: int) -> None:
    print(f"{mib} MiB per transfer, MB/s (medians):")
    print(f"  {'row':<26} {'direct':>8} {'relayed':>8} {'ratio':>6}  failed")
    for r in rows:
        direct, relayed = r["direct_mb_s"], r["relayed_mb_s"]
        failed = ", ".join(f"{p}: {e}" for p in ("direct", "relayed") for e in r[f"{p}_failed"])
        print(f"  {r['row']:<26} {direct or 0:>8.2f} {relayed or 0:>8.2f} "
              f"{r.get('ratio', 0):>6.2f}  {failed or '-'}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=8, help="MiB per transfer")
    parser.add_argument("--rounds", type=int, default=3, help="direct/relayed pairs per row")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 2
    rows = []
    for name, rate, data_mib in ROWS:
        print(f"row {name} ...", file=sys.stderr, flush=True)
        rows.append(_row(name, rate, data_mib, args))
    _print(rows, args.mib)
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
