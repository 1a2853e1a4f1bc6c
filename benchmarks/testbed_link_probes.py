"""Every link of a topology as the nodes' stream probe reads it, against its configured cap.

    sudo python -m benchmarks.testbed_link_probes --topology B [--rounds 3] [--busy 1]
        [--stream-seconds 4] [--json PATH]                                # in the repo root

A testbed of the topology (fusionllm.testbed: each host's CPU quota, links and caps); a bare
ControlHost serving probes in every host (py-libp2p, noise + yamux: the probe's real path),
then in each host in turn a prober that probes every other host ``--rounds`` times with the
node's default 1 MiB, round-robin over its peers, 0.3 s apart. ``--busy N`` runs N busy
Python loops in every host's cgroup meanwhile (what training does to a 0.2-0.8-core quota:
the probe's reader is throttled). ``--stream-seconds S`` also streams plain TCP for S s over
each ordered pair, one at a time, from a Python process inside the same quota (what the
link carries to Python there: the ceiling the probe can reach). No training runs: a
probe-only run costs a few minutes where an experiment costs tens.

Printed per link: the cap on the path, the probe's figure (median of the rounds, and the
best, which the bandwidth book would keep), its parts (``whole``: bytes over first byte to
ack, net of one RTT; ``tail``: the server's timing of the second half), the RTT, and the
figure over the cap. "within 20%" counts the best figure, as the planner sees it.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryDirectory

from fusionllm.node.children import JsonChild
from fusionllm.testbed import paths
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import load_topology

_ME = [sys.executable, "-m", "benchmarks.testbed_link_probes"]
_SERVER = [sys.executable, "-m", "tests.support.probe_main", "serve"]
_BUSY = [sys.executable, "-c", "while True: pass"]
_START_S = 90.0
_PROBE_BYTES = 1 << 20
_GAP_S = 0.3


def probe_peers(key: str, addr: str, rounds: int, targets: list[str]) -> None:
    """The prober child: ``rounds`` probes of every target, round-robin; one JSON line."""
    from fusionllm.node.p2p.control_host import ControlConfig, ControlHost
    from fusionllm.node.p2p.probes import probe_bandwidth

    config = ControlConfig(
        key_path=Path(key), listen_host=addr, probe_bytes=_PROBE_BYTES, probe_timeout_s=60.0,
        max_probes_served_per_peer_per_min=10**6,
    )  # fmt: skip
    host = ControlHost(config).start()
    peers = {target: host.connect(target) for target in targets}
    results = []
    for _ in range(rounds):
        for target, peer in peers.items():
            r = host.probe(peer, nbytes=_PROBE_BYTES)
            whole = probe_bandwidth(r.bytes, r.seconds, r.rtt)
            results.append({"target": target, "bandwidth": r.bandwidth, "whole": whole,
                            "raw": r.bytes / r.seconds, "tail": r.tail_bandwidth,
                            "wire": getattr(r, "wire_bandwidth", 0.0), "rtt": r.rtt})  # fmt: skip
            time.sleep(_GAP_S)
    print(json.dumps({"event": "probes", "results": results}), flush=True)
    host.close()


def _servers(bed: Testbed, workdir: Path, stack) -> dict[str, str]:
    """A probe server in every host; its listen address by host."""
    addrs = {}
    for host in bed.hosts:
        argv = [*_SERVER, str(workdir / f"{host}.key"), bed.address(host)]
        child = stack.enter_context(JsonChild(bed.command(host, argv), stdin=True, name=host))
        addrs[host] = child.next_event(_START_S)["addr"]
    return addrs


def _probe_from(bed: Testbed, src: str, addrs: dict[str, str], rounds: int, workdir: Path):
    targets = [addrs[h] for h in bed.hosts if h != src]
    names = {addrs[h]: h for h in bed.hosts}
    argv = [*_ME, "probe", str(workdir / f"{src}-prober.key"), bed.address(src), str(rounds),
            *targets]  # fmt: skip
    done = bed.run(src, argv, timeout=_START_S + 30 * rounds * len(targets))
    if done.returncode != 0:
        raise RuntimeError(f"the prober in {src} failed: {done.stderr[-2000:]}")
    results = json.loads(done.stdout.splitlines()[-1])["results"]
    return [{**r, "src": src, "dst": names[r["target"]]} for r in results]


def _links(topology, probes: list[dict], streams: dict) -> list[dict]:
    rows = []
    for src in topology.hosts:
        for dst in topology.hosts:
            if src.name == dst.name:
                continue
            mine = [p for p in probes if (p["src"], p["dst"]) == (src.name, dst.name)]
            cap = (topology.path_rate_mbps(src.name, dst.name) or 0.0) / 8
            figures = [p["bandwidth"] / 1e6 for p in mine]
            row = {
                "src": src.name, "dst": dst.name, "cap_mb_s": cap,
                "rtt_ms": topology.rtt_ms(src.name, dst.name),
                "median_mb_s": statistics.median(figures), "best_mb_s": max(figures),
                "whole_mb_s": statistics.median(p["whole"] for p in mine) / 1e6,
                "tail_mb_s": statistics.median(p["tail"] for p in mine) / 1e6,
                "max_tail_mb_s": max(p["tail"] for p in mine) / 1e6,
                "measured_rtt_ms": statistics.median(p["rtt"] for p in mine) * 1e3,
                "figures_mb_s": figures, "probes": mine,
            }  # fmt: skip
            if (src.name, dst.name) in streams:
                row["stream_mb_s"] = streams[src.name, dst.name]
            rows.append(row)
    return rows


def measure(name: str, rounds: int, busy: int, stream_s: float) -> dict:
    topology = load_topology(name)
    started, load = time.time(), _uptime()
    with TemporaryDirectory() as tmp, Testbed(topology) as bed, ExitStack() as stack:
        hogs = [bed.popen(h, _BUSY) for h in bed.hosts for _ in range(busy)]
        stack.callback(_stop, hogs)
        addrs = _servers(bed, Path(tmp), stack)
        probes = []
        for src in bed.hosts:
            probes += _probe_from(bed, src, addrs, rounds, Path(tmp))
            print(f"  probed from {src}", file=sys.stderr, flush=True)
        streams = {}
        if stream_s > 0:
            for src in bed.hosts:
                for dst in (h for h in bed.hosts if h != src):
                    result = paths.stream(bed, src, dst, seconds=stream_s)
                    streams[src, dst] = result["steady_mbps"] / 8
    return {
        "topology": name, "rounds": rounds, "busy": busy, "probe_bytes": _PROBE_BYTES,
        "started": time.strftime("%H:%M:%S", time.gmtime(started)), "load_start": load,
        "load_end": _uptime(), "links": _links(topology, probes, streams),
    }  # fmt: skip


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def _uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _print(result: dict) -> None:
    links = result["links"]
    print(f"topology {result['topology']}, {result['rounds']} rounds, busy {result['busy']}, "
          f"{result['started']} UTC, load {result['load_start']} -> "
          f"{result['load_end']}")  # fmt: skip
    print(f"{'link':10} {'cap':>7} {'median':>7} {'best':>7} {'whole':>7} {'tail':>7} "
          f"{'stream':>7} {'rtt':>6}/{'cfg':<5} {'best/cap':>8}")  # fmt: skip
    within = over = 0
    for r in links:
        ratio = r["best_mb_s"] / r["cap_mb_s"] if r["cap_mb_s"] else float("nan")
        within += abs(ratio - 1) <= 0.2
        over += ratio > 1.2
        stream = f"{r['stream_mb_s']:7.2f}" if "stream_mb_s" in r else f"{'-':>7}"
        print(f"{r['src'] + '>' + r['dst']:10} {r['cap_mb_s']:7.2f} {r['median_mb_s']:7.2f} "
              f"{r['best_mb_s']:7.2f} {r['whole_mb_s']:7.2f} {r['tail_mb_s']:7.2f} {stream} "
              f"{r['measured_rtt_ms']:6.1f}/{r['rtt_ms']:<5.1f} {ratio:8.2f}")  # fmt: skip
    print(f"best within 20% of the cap: {within}/{len(links)}; over 1.2x: {over}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"]:
        probe_peers(argv[1], argv[2], int(argv[3]), argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", action="append", help="A, B, C or a file (repeatable)")
    parser.add_argument("--rounds", type=int, default=3, help="probes per link (%(default)s)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops per host (%(default)s)")
    parser.add_argument("--stream-seconds", type=float, default=0.0,
                        help="also stream plain TCP over each pair this long (0: no)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.busy < 0 or args.stream_seconds < 0:
        parser.error("--rounds must be >= 1, --busy and --stream-seconds >= 0")
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 1
    results = []
    for name in args.topology or ["A", "B", "C"]:
        results.append(measure(name, args.rounds, args.busy, args.stream_seconds))
        _print(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
