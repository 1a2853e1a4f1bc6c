"""``fusionllm node``: run one node of a swarm, training what the swarm's plan asks of it."""

import argparse
import contextlib
import gc
import json
import signal
import sys
import threading
from pathlib import Path

from fusionllm.node.cli.announce_options import add_announce_options, announce_fields
from fusionllm.node.cli.config import add_config_option
from fusionllm.node.cli.keygen_cmd import add_swarm_key_option, swarm_key_of
from fusionllm.node.cli.measure_options import add_compute_options, add_probe_options, device_of
from fusionllm.node.cli.options import (
    add_data_options,
    add_device_option,
    add_run_options,
    add_swarm_address,
    add_task_options,
    load_data,
    run_spec_from,
)
from fusionllm.node.observe.listen import listen_arg

SAME_ON_EVERY_NODE = "the same on every node of a swarm"


def add_parser(commands) -> None:
    node = commands.add_parser(
        "node",
        help="run a node: join a swarm, agree on a plan with the others, train your part of it",
        description="Joins (or starts, without --bootstrap) a swarm: publishes this node's "
        "signed record on the DHT, measures bandwidth to a sample of peers and gossips it, and "
        "every epoch agrees on the swarm's plan with the other nodes (no coordinator). A node "
        "the plan names trains its stage with its neighbours; others wait in the backup pool. "
        "Every node of a swarm must use the same run and timing options. When the run reaches "
        "--steps the node writes its stage's parameters to --work-dir, leaves and exits 0. "
        "Every --checkpoint-every steps each stage is checkpointed to --work-dir and a copy "
        "kept by another member; restarted with the same --key and --work-dir, a node rejoins "
        "and offers what it saved. Ctrl-C (SIGINT) or SIGTERM leaves politely: the node "
        "finishes its step and hands its stage to a member that stays; Ctrl-C again quits at "
        "once.",
    )
    add_swarm_address(node, joining=True)
    _add_identity_and_port_options(node)
    add_announce_options(node)
    add_swarm_key_option(node)
    add_run_options(node)
    add_task_options(node, tasks=("train", "finetune", "serve"))
    add_data_options(node)
    add_device_option(node)
    _add_plan_options(node)
    _add_timing_options(node)
    _add_test_hooks(node)
    add_probe_options(node)
    add_compute_options(node)
    _add_role_options(node)
    _add_serve_options(node)
    add_config_option(node)  # last: it names every option above
    node.set_defaults(handler=run)


def _add_plan_options(node: argparse.ArgumentParser) -> None:
    group = node.add_argument_group("planning", SAME_ON_EVERY_NODE)
    group.add_argument("--min-stages", type=int, default=1, help="(default: %(default)s)")
    group.add_argument("--max-stages", type=int, default=8, help="(default: %(default)s)")
    group.add_argument(
        "--dense",
        action="store_true",
        help="never compress a link (AdaTopK off): the run then equals one process's",
    )
    group.add_argument(
        "--planner",
        choices=("opfence", "balanced", "naive"),
        default="opfence",
        help="how stages are planned: opfence (fences of fast links, cuts that balance compute "
        "and links, AdaTopK unless --dense), or a baseline that ignores links and sends dense: "
        "balanced (cuts that balance measured compute), naive (even layer split in peer-id "
        "order) (default: %(default)s)",
    )
    group.add_argument(
        "--min-peers",
        type=int,
        default=1,
        help="plan and train nothing until this many nodes are present, so a run starts on "
        "the whole swarm, not on the first node alone (default: %(default)s)",
    )
    group.add_argument(
        "--max-replicas",
        type=int,
        default=64,
        help="data-parallel replicas per stage at most (default: %(default)s)",
    )


def _add_timing_options(node: argparse.ArgumentParser) -> None:
    group = node.add_argument_group("timing and checkpoints", SAME_ON_EVERY_NODE)
    group.add_argument(
        "--heartbeat", type=float, default=5.0, help="record refresh, s (default: %(default)s)"
    )
    group.add_argument(
        "--ttl",
        type=float,
        default=15.0,
        help="record lifetime after the last heartbeat, s; a node that missed 3 heartbeats "
        "is already treated as gone (default: %(default)s)",
    )
    group.add_argument("--epoch", type=float, default=10.0, help="plan epoch, s (%(default)s)")
    group.add_argument(
        "--quiet-stride",
        type=int,
        default=16,
        help="an idle swarm whose members and plan stay the same acts only every this many "
        "epochs (a power of two; 1: every epoch); a change wakes it (default: %(default)s)",
    )
    group.add_argument(
        "--checkpoint-every",
        type=int,
        default=20,
        help="steps between checkpoints of every stage (0: none); a crash loses at most this "
        "many steps (default: %(default)s)",
    )
    group.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="longest wait for a neighbour's frame inside a step, s (default: %(default)s)",
    )
    group.add_argument(
        "--barrier-grace",
        type=float,
        default=30.0,
        help="how long a plan's start waits for a member, s, plus the time its stage's state "
        "takes at the measured bandwidth; then the member is suspected and planned around "
        "for 15 s, twice as long each repeat (default: %(default)s)",
    )


def _add_test_hooks(node: argparse.ArgumentParser) -> None:
    """Fault injection for tests, hidden from --help and from the config file."""
    node.add_argument(
        "--checkpoint-pause",
        type=float,
        default=0.0,
        help=argparse.SUPPRESS,  # fault injection for tests: sleep between write and rename
    )
    node.add_argument(
        "--fault-abandon-after",
        type=int,
        default=0,
        # Test hook (tests/integration/test_stalling_members.py): after this many steps of a
        # plan the node abandons the next step (once), as when its view briefly drops a member.
        help=argparse.SUPPRESS,
    )
    node.add_argument(
        "--fault-stall-after",
        type=int,
        default=0,
        # Test hook (tests/integration/test_stalling_members.py): after this many steps of a
        # plan the node stops sending frames and stepping, its heartbeat still up.
        help=argparse.SUPPRESS,
    )
    node.add_argument(
        "--fault-late-barrier",
        type=float,
        default=0.0,
        # Test hook (tests/integration/test_observe.py): come this many seconds late to the
        # first plan's READY barrier, as an honest member slowed by a view split would.
        help=argparse.SUPPRESS,
    )
    node.add_argument(
        "--fault-under-report",
        type=float,
        default=1.0,
        # Test hook (test_stalling_members.py): the node says it computed this many times
        # less than it measured, in its step summaries and to its own pace (a liar).
        help=argparse.SUPPRESS,
    )


def _add_identity_and_port_options(node: argparse.ArgumentParser) -> None:
    node.add_argument(
        "--key",
        default="~/.fusionllm/identity.key",
        help="identity key file, created (mode 0600) if missing (default: %(default)s)",
    )
    node.add_argument(
        "--work-dir",
        help="where the node writes what it trained (default: beside --key, named after it)",
    )
    node.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    node.add_argument("--port", type=int, default=0, help="control/data port (default: free)")
    node.add_argument("--dht-port", type=int, default=0, help="DHT port (default: free)")
    node.add_argument(
        "--lane-port",
        type=int,
        default=0,
        help="where peers open lanes, direct TCP connections for tensors sealed with a key "
        "agreed over the encrypted control connection (default: free; open it in a "
        "firewall or container for full speed)",
    )
    node.add_argument(
        "--no-lanes",
        action="store_true",
        help="send tensors only inside the control connection (slower; for networks that "
        "allow one port only)",
    )


def _add_role_options(node: argparse.ArgumentParser) -> None:
    """What the node does in the swarm and what it shows of it."""
    node.add_argument("--duration", type=float, help="leave after this many seconds")
    node.add_argument(
        "--no-train",
        action="store_true",
        help="observe: follow the swarm's plans and train nothing; the node's record says so, "
        "and no plan seats it",
    )
    node.add_argument(
        "--control-only",
        action="store_true",
        help=argparse.SUPPRESS,  # tests and benchmarks of the control plane: plannable, no trainer
    )
    node.add_argument("--events", action="store_true", help="print events as JSON lines")
    node.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        type=listen_arg,
        help="serve Prometheus metrics at http://HOST:PORT/metrics: step, loss, tokens/s, "
        "step time, bytes per link before and after compression and its codec, peers, the "
        "plan, refusals by reason, DHT rounds, checkpoint age (port 0: a free one, printed "
        "at start; default: off)",
    )


def _add_serve_options(node: argparse.ArgumentParser) -> None:
    group = node.add_argument_group("serving (--task serve)")
    group.add_argument(
        "--max-sessions", type=int, default=16, help="open sessions at most (%(default)s)"
    )
    group.add_argument(
        "--max-cache-mib",
        type=int,
        default=1024,
        help="KV-cache memory of all sessions together, MiB; a session over it is refused "
        "as overloaded (default: %(default)s)",
    )
    group.add_argument(
        "--session-idle",
        type=float,
        default=60.0,
        help="end a session whose client is silent this many s (default: %(default)s)",
    )


def _kind_of(args: argparse.Namespace) -> str:
    """What the swarm does: fine-tuning is training (its adapters are in the run's settings)."""
    return "serve" if args.task == "serve" else "train"


def _serve_limits(args: argparse.Namespace):
    from fusionllm.node.serve.sessions import ServeLimits

    return ServeLimits(
        max_sessions=args.max_sessions,
        max_cache_bytes=args.max_cache_mib << 20,
        idle_s=args.session_idle,
    )


def _node_config(args: argparse.Namespace):
    from fusionllm.node.control.node_config import NodeConfig
    from fusionllm.node.control.swarm_settings import SwarmSettings

    swarm_key = swarm_key_of(args)
    settings = SwarmSettings(
        swarm=args.swarm,
        key_digest=swarm_key.digest if swarm_key is not None else "",
        run=run_spec_from(args, load_data(args)),
        compress=not args.dense,
        planner=args.planner,
        min_peers=args.min_peers,
        min_stages=args.min_stages,
        max_stages=args.max_stages,
        max_replicas=args.max_replicas,
        heartbeat_s=args.heartbeat,
        ttl_s=args.ttl,
        epoch_s=args.epoch,
        checkpoint_every=args.checkpoint_every,
        quiet_max_stride=args.quiet_stride,
        task=_kind_of(args),
    )
    return NodeConfig(
        settings=settings,
        key_path=Path(args.key).expanduser(),
        bootstrap=tuple(args.bootstrap or ()),
        listen_host=args.host,
        dht_port=args.dht_port,
        control_port=args.port,
        lane_port=args.lane_port,
        lanes=not args.no_lanes,
        **announce_fields(args),
        swarm_key=swarm_key,
        probe_interval_s=args.probe_interval,
        probe_fanout=args.probe_fanout,
        probe_bytes=int(args.probe_kib * 1024),
        device=device_of(args),
        compute_device=args.device,
        rehearse_s=args.rehearse_s,
        compute_threads=args.threads or 0,
        uplink=args.uplink_mbps * 125_000 if args.uplink_mbps else None,
        downlink=args.downlink_mbps * 125_000 if args.downlink_mbps else None,
        observer=args.no_train,
    )


def _printer(args: argparse.Namespace, swarm: str):
    """What the node prints of its events. The control plane and the trainer emit from their
    own threads: each event goes out as one write under a lock, or two threads' ``print``
    calls interleave their text and newlines and a reader of ``--events`` loses both lines
    (a CI run lost one step's loss that way)."""
    lock = threading.Lock()

    def on_event(event: dict) -> None:
        text = json.dumps(event) if args.events else _describe(event, swarm)
        if text is None:
            return
        with lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    return on_event


def _describe(event: dict, swarm: str, every: int = 10) -> str | None:
    """The human line(s) for an event, or None for one not shown without ``--events``."""
    kind = event["event"]
    if kind == "ready":
        return (
            f"node {event['peer_id']} joined swarm {swarm}\n"
            f"  others can bootstrap from: {' '.join(event['dht_addrs'])}"
        )
    if kind == "epoch" and event["changed"]:
        return (
            f"epoch {event['epoch']}: plan {event['digest'][:12]} with "
            f"{len(event['stages'])} stages, {len(event['backup'])} in backup, "
            f"{len(event['members'])} members; this node: {event['state']}"
        )
    if kind == "train_plan":
        return (
            f"training plan {event['digest'][:12]} from step {event['start_step']}: "
            f"this node serves stage {event['stage']} replica {event['replica']}"
        )
    if kind == "step" and (event["step"] % every == 0 or event.get("eval_loss") is not None):
        line = (
            f"step {event['step']:>5}  loss {event['loss']:.4f}  "
            f"{event['tokens_per_s']:,.0f} tokens/s"
        )
        held_out = event.get("eval_loss")
        return line if held_out is None else f"{line}  validation loss {held_out:.4f}"
    if kind == "plan_end" and event["outcome"] in ("failed", "parted"):
        return f"plan {event['digest'][:12]} ended ({event['outcome']}): {event['detail']}"
    if kind == "metrics":
        return f"metrics at {event['url']}"
    if kind == "reachability":
        from fusionllm.node.p2p.reachability import explain  # py-libp2p: only when needed

        return explain(
            event["verdict"], event["addrs"], event["observed"], event.get("upnp", False)
        )
    if kind in ("saved", "finished"):
        return f"{kind}: {json.dumps({k: v for k, v in event.items() if k != 'event'})}"
    return None


class _Leave:
    """SIGINT (Ctrl-C, ``kill -INT``) and SIGTERM (docker stop, kill): leave the swarm
    politely (run_node's ``stop``). SIGINT gets this handler explicitly: a node started as a
    script's background job inherits SIGINT ignored, and Python then raises no
    KeyboardInterrupt for it, so ``kill -INT`` did nothing. Once asked, a second SIGINT
    raises KeyboardInterrupt, for whoever will not wait for the hand-over (up to
    2 x --step-timeout); the flag keeps a signal landing inside ``stop.set()`` from taking
    the Event's lock again (a deadlock)."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._asked = False

    def __call__(self, signum: int, _frame: object) -> None:
        if self._asked:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self._asked = True
        self._stop.set()


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.swarm_config import SwarmNodeConfig
    from fusionllm.node.swarm_node import run_node

    node_config = _node_config(args)
    train = not (args.no_train or args.control_only)
    if train:  # a node that trains nothing never loads torch
        import torch

        from fusionllm.node.devices import resolve_device

        resolve_device(args.device)  # a clear error before the node joins anything
        if args.threads:
            torch.set_num_threads(args.threads)
    key = node_config.key_path
    work_dir = Path(args.work_dir).expanduser() if args.work_dir else key.with_suffix("")
    if work_dir == key:
        work_dir = key.parent / f"{key.name}.work"
    config = SwarmNodeConfig(
        node=node_config,
        work_dir=work_dir,
        step_timeout_s=args.step_timeout,
        barrier_grace_s=args.barrier_grace,
        checkpoint_pause_s=args.checkpoint_pause,
        fault_stall_after=args.fault_stall_after,
        fault_abandon_after=args.fault_abandon_after,
        fault_under_report=args.fault_under_report,
        fault_late_barrier_s=args.fault_late_barrier,
        train=train,
        pin_cores=args.pin_cores,
        data_path=Path(args.data).expanduser() if args.data else None,
        data_dtype=args.data_dtype,
        device=args.device,
        metrics=args.metrics,
        task=_kind_of(args),
        serve_limits=_serve_limits(args) if args.task == "serve" else None,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _Leave(stop))
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: out at once, cleaned up
        run_node(
            config,
            on_event=_printer(args, node_config.settings.swarm),
            duration_s=args.duration,
            stop=stop,
        )
    # The node has left and closed what it ran; its objects (the model, its traced graph,
    # libp2p's and trio's) live until the process ends. The interpreter's last collection
    # walked them all: 5 s of a 10 s exit on an idle host, most of a container's stop.
    gc.freeze()
    return 0
