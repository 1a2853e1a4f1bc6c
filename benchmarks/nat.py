"""Two homes behind NAT, reached through a public member's relay: how long a node takes to
learn it is private, how long to its first direct (punched) lane, and what a link carries
direct against relayed on the same caps.

    sudo python -m benchmarks.nat [--rounds 3] [--rate 100] [--numel 262144] [--json PATH]

One testbed (fusionllm.testbed): a public host running a member's relay and dial-back, a
home behind a cone router ("cone") that reserves a slot on it and echoes tensors back, and
two homes that reach it through the relay only: one behind a cone router ("cone2": lanes
punched, lane/punch.py) and one behind a symmetric router ("sym": no punch meets, frames on
the relayed stream). Every link has the same delay and cap. Each home first asks the public
host to dial it back (the reachability check's dial-back) and punches from the IP the
verdict saw. Rounds alternate cone2 and sym (tests/support/punch_main.py); the table gives
medians. Tokens/s: the MB/s as GPT-2 small's activations (768 fp32 values a token, one way),
i.e. what the link would carry of a pipeline's traffic, not a training run's tokens/s.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.router import unavailable as no_routers
from fusionllm.testbed.topology import parse_topology

RELAY = [sys.executable, "-m", "tests.support.relay_main"]
PUNCH = [sys.executable, "-m", "tests.support.punch_main"]
HOSTS = ("pub", "cone", "cone2", "sym")
TOKEN_BYTES = 768 * 4  # a GPT-2 small activation per token, fp32
_START_S = 90.0


def _topology(rate: float | None, delay_ms: float) -> dict:
    defaults = {"delay_ms": delay_ms, **({"rate_mbps": rate} if rate else {})}
    hosts = [{"name": "pub"}, {"name": "cone", "nat": "cone"},
             {"name": "cone2", "nat": "cone"}, {"name": "sym", "nat": "symmetric"}]  # fmt: skip
    return {"name": "nat-bench", "defaults": defaults, "hosts": hosts}


def _away(bed: Testbed, host: str, key: Path, relay: str, home: str, args) -> dict:
    ip = "verdict" if args.ip == "verdict" else bed.wan_address(host)
    argv = [*PUNCH, "away", str(key), bed.address(host), ip, relay, home,
            str(args.frames), str(args.numel)]  # fmt: skip
    done = bed.run(host, argv, timeout=_START_S + 120)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    found = {e["event"]: e for e in events}
    if "done" not in found:
        return {"host": host, "error": done.stderr[-2000:], "log": done.stderr[-20000:]}
    return {"host": host, **found.get("verdict", {}), **found["done"]}


def run(args: argparse.Namespace, keys_dir: Path) -> dict:
    keys = {n: keys_dir / f"{n}.key" for n in HOSTS}
    ids = {n: peer_id_of(load_or_create_identity(k)) for n, k in keys.items()}
    quiet = {"stderr": subprocess.DEVNULL}  # py-libp2p's logs
    runs: list[dict] = []
    with Testbed(parse_topology(_topology(args.rate, args.delay_ms))) as bed:
        relay_argv = [*RELAY, "relay", str(keys["pub"]), bed.address("pub"), *ids.values()]
        with JsonChild(bed.command("pub", relay_argv), stdin=True, name="relay", **quiet) as relay:
            addr = relay.next_event(_START_S)["addr"]
            argv = [*PUNCH, "home", str(keys["cone"]), bed.address("cone"), "verdict", addr]
            home_log = {"stderr": args.home_log} if args.home_log else quiet
            with JsonChild(bed.command("cone", argv), stdin=True, name="home", **home_log) as home:
                home_verdict = home.next_event(_START_S)
                reserved = home.next_event(_START_S)["ok"]
                for i in range(args.rounds):
                    print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    for host in ("cone2", "sym"):
                        runs.append(_away(bed, host, keys[host], addr, ids["cone"], args))
                home.close_stdin()
                lanes = home.next_event(30)
            relay.close_stdin()
        wan = {n: bed.wan_address(n) for n in HOSTS}
    return {"home_verdict": home_verdict, "reserved": reserved, "home_lanes": lanes,
            "wan": wan, "runs": runs, "summary": _summary(runs)}  # fmt: skip


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def _summary(runs: list[dict]) -> dict:
    summary = {}
    for host, path in (("cone2", "punched"), ("sym", "relayed")):
        mine = [r for r in runs if r["host"] == host and "error" not in r]
        mb_s = _median(mine, "mb_s")
        summary[path] = {
            "runs": len(mine),
            "punched": sum(bool(r["punched"]) for r in mine),
            "verdict_s": _median(mine, "verdict_s"),
            "first_s": _median(mine, "first_s"),
            "mb_s": mb_s,
            "tokens_s": None if mb_s is None else mb_s * 1e6 / TOKEN_BYTES,
        }
    return summary


def _print(result: dict, args: argparse.Namespace) -> None:
    cap = f"{args.rate:g} Mbit/s" if args.rate else "uncapped"
    print(f"links {cap}, {args.delay_ms:g} ms; {args.frames} round trips of "
          f"{args.numel * 4 / 2**20:.2f} MiB; medians of {args.rounds} runs")  # fmt: skip
    verdict = result["home_verdict"]
    print(f"home behind cone: {verdict['verdict']} in {verdict['verdict_s']:.2f} s, seen at "
          f"{', '.join(verdict['observed'])}")  # fmt: skip
    print(f"  {'path':<9} {'punched':>8} {'verdict s':>10} {'first s':>8} {'MB/s':>8} {'tok/s':>9}")
    for path, s in result["summary"].items():
        if s["mb_s"] is None:
            print(f"  {path:<9} no run finished")
            continue
        verdict_s = "-" if s["verdict_s"] is None else f"{s['verdict_s']:.2f}"
        print(f"  {path:<9} {s['punched']:>4}/{s['runs']:<3} {verdict_s:>10} "
              f"{s['first_s']:>8.2f} {s['mb_s']:>8.2f} {s['tokens_s']:>9.0f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each path (alternating)")
    parser.add_argument("--rate", type=float, default=100.0, help="cap of every link, Mbit/s "
                        "(0: uncapped)")  # fmt: skip
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay per link")
    parser.add_argument("--frames", type=int, default=8, help="tensor round trips per run")
    parser.add_argument("--numel", type=int, default=1 << 18, help="fp32 values per tensor")
    parser.add_argument("--keys", type=Path, default=Path("/tmp/fusionllm-nat-bench"),
                        help="where the hosts' identity files are kept")  # fmt: skip
    parser.add_argument("--ip", choices=("verdict", "wan"), default="verdict",
                        help="the away homes punch from their dial-back verdict's IP, or are "
                        "told their router's (no dial-back: no verdict time)")  # fmt: skip
    parser.add_argument("--home-log", type=Path, help="the echoing home's log goes here")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if (why := unavailable() or no_routers()) is not None:
        parser.error(f"the testbed cannot run here: {why}")
    args.keys.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, **run(args, args.keys)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    _print(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
