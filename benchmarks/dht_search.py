"""What one DHT store and one get cost the whole swarm, by search width (DhtConfig.search_beam).

    python benchmarks/dht_search.py [--nodes 16] [--ops 64] [--beams 20 8] [--json P]

For each beam, starts ``--nodes`` real DHT workers (hivemind and its p2pd each) on loopback,
then stores ``--ops`` ~2 KB records under one key (every node its own subkey, as node records
are) and gets that key ``--ops`` times, round robin over the nodes. Reports the CPU time of
every worker and p2pd together per op (what the swarm pays, not only the asking node), the
wall time per op, and the fewest entries a get returned (all nodes' records must be found).
hivemind's default beam is its bucket size, 20: with fewer than ~20 nodes every op asks all.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

from fusionllm.dht.client import DhtClient, DhtConfig


def _swarm(nodes: int, beam: int) -> list[DhtClient]:
    clients: list[DhtClient] = []
    try:
        for _ in range(nodes):
            peers = (clients[0].maddrs[0],) if clients else ()
            config = DhtConfig(
                swarm="bench", initial_peers=peers, validate_records=False, search_beam=beam
            )
            clients.append(DhtClient(config).start())
    except BaseException:
        for client in clients:
            client.close()
        raise
    return clients


def _cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def measure(nodes: int, beam: int, ops: int) -> dict:
    clients = _swarm(nodes, beam)
    try:
        time.sleep(5.0)  # let the joins' own lookups finish
        procs = psutil.Process().children(recursive=True)
        row: dict = {"nodes": nodes, "beam": beam}
        for op in ("store", "get"):
            cpu, started, fewest = _cpu_s(procs), time.perf_counter(), nodes
            for i in range(ops):
                client = clients[(7 * i) % nodes]
                if op == "store":
                    client.store("members", f"node{i % nodes}", os.urandom(2000), time.time() + 120)
                else:
                    fewest = min(fewest, len(client.get("members")))
            row[f"{op}_cpu_ms"] = 1e3 * (_cpu_s(procs) - cpu) / ops
            row[f"{op}_wall_ms"] = 1e3 * (time.perf_counter() - started) / ops
        row["fewest_entries"] = fewest
        return row
    finally:
        for client in clients:
            client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--ops", type=int, default=64)
    parser.add_argument("--beams", type=int, nargs="+", default=[20, 8])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args()
    print(f"{'nodes':>5} {'beam':>5} {'store CPU ms':>13} {'get CPU ms':>11} "
          f"{'store ms':>9} {'get ms':>7} {'fewest':>7}", flush=True)  # fmt: skip
    rows = []
    for beam in args.beams:
        r = measure(args.nodes, beam, args.ops)
        rows.append(r)
        print(f"{r['nodes']:>5} {r['beam']:>5} {r['store_cpu_ms']:>13.1f} {r['get_cpu_ms']:>11.1f} "
              f"{r['store_wall_ms']:>9.1f} {r['get_wall_ms']:>7.1f} {r['fewest_entries']:>7}",
              flush=True)  # fmt: skip
    base = rows[0]
    for r in rows[1:]:
        store = r["store_cpu_ms"] / base["store_cpu_ms"]
        get = r["get_cpu_ms"] / base["get_cpu_ms"]
        print(f"beam {r['beam']} vs {base['beam']}: store CPU x{store:.2f}, get CPU x{get:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
