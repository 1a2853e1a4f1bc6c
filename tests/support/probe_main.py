"""The nodes' bandwidth probe between two testbed hosts, each a bare ControlHost process.

    python -m tests.support.probe_main serve KEY ADDR          # prints {"event": "ready", ...}
    python -m tests.support.probe_main probe KEY ADDR TARGET ROUNDS SIZE...

``probe_link`` runs both in a testbed (tests/testbed, benchmarks/testbed_probes.py): the
server in ``dst``, the prober in ``src``, ROUNDS probes of each SIZE 0.5 s apart on one
connection (idle between, as between a node's probe rounds); it returns one dict per probe
(``bytes``, ``bandwidth`` as the node computes it, ``raw`` bytes over seconds, ``rtt``,
``tail``: the payload's second half as the server timed it).
"""

import json
import sys
import time
from pathlib import Path

from fusionllm.node.children import JsonChild
from fusionllm.testbed.bed import Testbed

_START_S = 60.0


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


def probe(key: str, addr: str, target: str, rounds: int, sizes: list[int]) -> None:
    host = _host(key, addr, max(sizes))
    peer = host.connect(target)
    results = []
    for _ in range(rounds):
        for size in sizes:
            r = host.probe(peer, nbytes=size)
            results.append({"bytes": size, "bandwidth": r.bandwidth, "raw": r.bytes / r.seconds,
                            "rtt": r.rtt, "tail": r.tail_bandwidth,
                            "wire": r.wire_bandwidth})  # fmt: skip
            time.sleep(0.5)
    print(json.dumps({"event": "probes", "results": results}), flush=True)
    host.close()


def probe_link(
    bed: Testbed, src: str, dst: str, workdir: Path, *, rounds: int, sizes: list[int]
) -> list[dict]:
    me = [sys.executable, "-m", "tests.support.probe_main"]
    server_argv = [*me, "serve", str(workdir / f"{dst}.key"), bed.address(dst)]
    with JsonChild(bed.command(dst, server_argv), stdin=True, name="probe-server") as server:
        target = server.next_event(_START_S)["addr"]
        argv = [*me, "probe", str(workdir / f"{src}.key"), bed.address(src), target,
                str(rounds), *map(str, sizes)]  # fmt: skip
        done = bed.run(src, argv, timeout=_START_S + 30 * rounds * len(sizes))
    if done.returncode != 0:
        raise RuntimeError(f"the prober failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])["results"]


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        serve(*argv[1:3])
    elif argv[:1] == ["probe"]:
        probe(*argv[1:4], int(argv[4]), [int(s) for s in argv[5:]])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
