"""--announce-addr and the announced ports: where peers reach a node behind a forward."""

import argparse

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.announce import AnnounceAddr


def _announce_addr(text: str) -> AnnounceAddr:
    try:
        return AnnounceAddr.parse(text)
    except ConfigError as exc:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_announce_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "reachability",
        "what peers are told to dial when this node listens behind a port forward, in a "
        "container (docker run -p) or on a cloud VM with a public IP",
    )
    group.add_argument(
        "--announce-addr",
        action="append",
        type=_announce_addr,
        metavar="HOST[:PORT]",
        help="an IP address peers can reach; PORT: where --port is forwarded (default: "
        "--port). Repeat for several (e.g. IPv4 and IPv6). Needs a fixed --dht-port; lanes "
        "and the DHT are announced on the same IP (default: the listen address)",
    )
    group.add_argument(
        "--announce-dht-port",
        type=int,
        default=0,
        metavar="PORT",
        help="where --dht-port is forwarded (default: --dht-port)",
    )
    group.add_argument(
        "--announce-lane-port",
        type=int,
        default=0,
        metavar="PORT",
        help="where --lane-port is forwarded, named in lane offers (default: --lane-port, "
        "or the free port lanes took)",
    )
    group.add_argument(
        "--no-upnp",
        action="store_true",
        help="never ask the home router to map ports (UPnP-IGD). By default a node that "
        "members cannot dial asks the router on its LAN (a 3 s wait where none answers) to "
        "forward its ports, renews the lease and removes the mapping when it stops; never "
        "asked with --announce-addr or where members can dial it already",
    )


def announce_fields(args: argparse.Namespace) -> dict:
    """NodeConfig's reachability fields from the options."""
    return {
        "announce": tuple(args.announce_addr or ()),
        "announce_dht_port": args.announce_dht_port,
        "announce_lane_port": args.announce_lane_port,
        "upnp": not args.no_upnp,
    }
