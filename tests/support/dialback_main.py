"""Dial-back between testbed hosts, each a bare PeerHost process (py-libp2p, noise + yamux).

    python -m tests.support.dialback_main serve KEY ADDR       # prints {"event": "ready", ...}
    python -m tests.support.dialback_main ask KEY ADDR TARGET...  # one JSON line, then exits

A server answers ``/fusionllm/dialback/1.0.0`` and, to compare, py-libp2p's own AutoNAT v1
(``/libp2p/autonat/1.0.0``). The asker dials every TARGET, asks each to dial it back at its
listen port, prints the answers and the verdict (``reachability.judge``), and what the first
target's AutoNAT says when asked to dial it back at the IP the target saw.
"""

import contextlib
import json
import sys
from pathlib import Path

from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.dialback import DIALBACK_PROTOCOL, DialBackConfig, DialBackServer, ask
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.reachability import judge
from fusionllm.testbed.bed import Testbed

_START_S = 60.0
CONFIG = DialBackConfig(dial_timeout_s=3.0)


def _host(key: str, addr: str) -> tuple[PeerHost, object]:
    from libp2p.host.autonat.autonat import AutoNATService

    host = PeerHost(HostConfig(key_path=Path(key), listen_host=addr, dial_timeout_s=10.0))
    host.start()
    autonat = host.call_sync(lambda: AutoNATService(host.libp2p, serve=True, confirmations=1))
    return host, autonat


def serve(key: str, addr: str) -> None:
    host, _ = _host(key, addr)
    host.set_stream_handler(DIALBACK_PROTOCOL, DialBackServer(CONFIG).serve)
    print(json.dumps({"event": "ready", "addr": host.addrs[0]}), flush=True)
    sys.stdin.read()  # until the parent closes it
    host.close()


def _autonat_says(host: PeerHost, autonat, peer, ip: str, port: int) -> int:
    from libp2p.peer.id import ID
    from multiaddr import Multiaddr

    addrs = [Multiaddr(f"/ip4/{ip}/tcp/{port}").to_bytes()]
    status, _ = host.call(lambda: autonat.query_server(ID.from_base58(peer), addrs, 30.0))
    return int(status)


def asker(key: str, addr: str, targets: list[str]) -> None:
    from libp2p.peer.id import ID

    host, autonat = _host(key, addr)
    port = int(host.bound_addrs[0].split("/tcp/")[1].split("/")[0])
    peers = [host.connect(t) for t in targets]
    answers = [host.call(ask, host.libp2p, ID.from_base58(p), [port], CONFIG) for p in peers]
    verdict = judge(answers, listen_ips=[addr], confirmations=len(peers))
    status = _autonat_says(host, autonat, peers[0], answers[0].observed_ip, port)
    print(json.dumps({
        "event": "verdict", "verdict": verdict.verdict, "addrs": verdict.addrs,
        "observed_ips": verdict.observed_ips, "answers": [a.reached[port] for a in answers],
        "autonat_status": status, "port": port,
    }), flush=True)  # fmt: skip
    host.close()


def reachability(bed: Testbed, servers: list[str], askers: list[str], workdir: Path) -> dict:
    """Each of ``askers`` asks every one of ``servers``: asker -> its verdict line."""
    me = [sys.executable, "-m", "tests.support.dialback_main"]
    with contextlib.ExitStack() as stack:
        targets = []
        for name in servers:
            argv = [*me, "serve", str(workdir / f"{name}.key"), bed.address(name)]
            child = JsonChild(bed.command(name, argv), stdin=True, name=f"dialback-{name}")
            targets.append(stack.enter_context(child).next_event(_START_S)["addr"])
        verdicts = {}
        for name in askers:
            argv = [*me, "ask", str(workdir / f"{name}.key"), bed.address(name), *targets]
            done = bed.run(name, argv, timeout=_START_S + 60)
            if done.returncode != 0:
                raise RuntimeError(f"the asker in {name} failed: {done.stderr[-2000:]}")
            verdicts[name] = json.loads(done.stdout.splitlines()[-1])
    return verdicts


def main(argv: list[str]) -> int:
    command = {"serve": lambda a: serve(*a[:2]), "ask": lambda a: asker(a[0], a[1], a[2:])}
    if argv[:1] not in (["serve"], ["ask"]) or len(argv) < (3 if argv[0] == "serve" else 4):
        print(__doc__, file=sys.stderr)
        return 2
    command[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
