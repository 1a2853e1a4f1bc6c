"""``fusionllm status``: what a swarm looks like from its DHT, without joining it."""

import argparse
import contextlib
import json

from fusionllm.node.cli.keygen_cmd import add_swarm_key_option, swarm_key_of
from fusionllm.node.cli.options import add_swarm_address
from fusionllm.node.observe.listen import listen_arg, url_of


def add_parser(commands) -> None:
    status = commands.add_parser(
        "status",
        help="show a swarm: peers, devices, measured links, fences, stages, backups",
        description="Reads the swarm's records from the DHT as a client (it joins nothing "
        "and stores nothing) and prints what the nodes published and the plan most of them "
        "follow.",
    )
    add_swarm_address(status, joining=False)
    add_swarm_key_option(
        status,
        text="watch a private swarm: its records are sealed with this key (the nodes' "
        "--swarm-key file; it must be private, chmod 600). Nothing is written to the swarm",
    )
    status.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="give up after this many s (default: %(default)s)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    how = status.add_mutually_exclusive_group()
    how.add_argument(
        "--serve",
        metavar="HOST:PORT",
        type=listen_arg,
        help="instead of printing once, serve a read-only page of the swarm at "
        "http://HOST:PORT/ (fences, stages and who serves them, links with bandwidth and "
        "codec, step and loss curve) that refreshes itself; the swarm is read once per "
        "--interval however many browsers watch (port 0: a free one, printed)",
    )
    how.add_argument(
        "--watch",
        action="store_true",
        help="instead of printing once, read the swarm every --interval until stopped "
        "(Ctrl-C, SIGTERM), starting the DHT client once; with --json one line per reading",
    )
    status.add_argument(
        "--interval",
        type=float,
        default=3.0,
        help="with --serve or --watch: seconds between reads of the swarm (default: %(default)s)",
    )
    status.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.control.status import format_status, gather

    if args.serve is not None:
        return _serve(args)
    if args.watch:
        return _watch(args)

    swarm_key = swarm_key_of(args)
    status = gather(args.bootstrap, args.swarm, timeout_s=args.timeout, swarm_key=swarm_key)
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def _watch(args: argparse.Namespace) -> int:
    import signal

    from fusionllm.node.control.status import format_status, watch
    from fusionllm.node.observe.feed import FeedConfig

    interval_s = FeedConfig(interval_s=args.interval).interval_s  # the page's bounds
    swarm_key = swarm_key_of(args)
    # SIGTERM (a benchmark or a service manager stopping us) ends it as Ctrl-C does, so the
    # DHT client is closed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def emit(status: dict) -> None:
        text = json.dumps(status) if args.json else format_status(status) + "\n"
        print(text, flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        watch(
            args.bootstrap,
            args.swarm,
            emit,
            interval_s=interval_s,
            timeout_s=args.timeout,
            swarm_key=swarm_key,
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from fusionllm.node.control.status import read_swarm, status_client
    from fusionllm.node.observe.feed import FeedConfig, StatusFeed
    from fusionllm.node.observe.page import listening_socket, serve, status_app

    config = FeedConfig(interval_s=args.interval)
    swarm_key = swarm_key_of(args)  # a bad key file fails here, before the port is taken
    sock = listening_socket(*args.serve)  # a taken port fails here, before the DHT starts
    try:
        client = status_client(
            args.bootstrap, args.swarm, timeout_s=args.timeout, swarm_key=swarm_key
        )
        feed = StatusFeed(lambda: read_swarm(client, args.swarm, swarm_key=swarm_key), config)
        feed.start()
        try:
            host, port = sock.getsockname()[:2]
            print(f"status page at {url_of(host, port)} (the swarm read every "
                  f"{config.interval_s:g} s; Ctrl-C stops)", flush=True)  # fmt: skip
            serve(status_app(feed), sock)
        finally:
            feed.stop()  # before the client closes under a read
            client.close()
    finally:
        sock.close()
    return 0
