"""One pipeline stage (or one replica of it) as a process, driven by a launcher over stdin/stdout.

    python -m fusionllm.node.pipeline.stage_main --config run.json --stage S [--replica R] --key K

Protocol (one JSON object per line), like ``transport_main``:

- it prints ``{"event": "ready", "peer_id", "addrs"}`` once its transport listens;
- it reads ``{"cmd": "start", "peers": [{"stage", "replica", "peer_id", "addr"}, ...]}``
  (every process of the run), dials them and trains ``config.steps`` steps, printing
  ``{"event": "step", ...}`` after each;
- it prints ``{"event": "done", ...}`` (and writes its parameters to ``--out`` if given), then
  waits for ``{"cmd": "quit"}`` so that no peer loses a frame it still needs;
- on an error it prints ``{"event": "error", "error": ...}`` and exits 1. It exits when stdin
  closes too, so a launcher that dies takes its stages with it.
"""

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fusionllm.common.cpus import parse_cores, pin
from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.node.errors import PipelineError
from fusionllm.node.p2p.transport import Transport, TransportConfig
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.expectations import Expectations
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.runner import PipelineRunner
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_layout,
    build_model,
    load_dataset,
)

logger = get_logger(__name__)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as a JSON file")
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--key", required=True, help="identity key file (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--out", help="write the final parameters here (torch.save)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--cpus",
        type=parse_cores,
        help="run on these cores only, e.g. 0 or 2,3 (default: wherever the OS puts us)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="longest wait for a frame")
    parser.add_argument("--device", default="cpu", help="auto|cpu|cuda|cuda:N (%(default)s)")
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


class _Lines:
    """stdin commands read by one thread; stdout events written whole, one per line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commands: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, name="stdin", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            if line.strip():
                try:
                    command = json.loads(line)
                except ValueError:
                    self.write({"event": "error", "error": f"not JSON: {line[:80]!r}"})
                    continue
                with self._cond:
                    self._commands.append(command)
                    self._cond.notify_all()
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def next_command(self, name: str) -> dict[str, Any] | None:
        """The next command called ``name`` (others are ignored); None once stdin closed."""
        with self._cond:
            while True:
                while self._commands:
                    command = self._commands.pop(0)
                    if command.get("cmd") == name:
                        return command
                if self.closed:
                    return None
                self._cond.wait()

    def write(self, obj: dict[str, Any]) -> None:
        with self._lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()


def _peers(command: dict[str, Any]) -> tuple[dict[Role, str], dict[Role, str]]:
    ids, addrs = {}, {}
    for entry in command["peers"]:
        role = Role(int(entry["stage"]), int(entry["replica"]))
        ids[role] = str(entry["peer_id"])
        addrs[role] = str(entry["addr"])
    return ids, addrs


def run(args: argparse.Namespace, lines: _Lines) -> int:
    torch.set_num_threads(args.threads)
    config = TrainConfig.from_json(Path(args.config).read_text())
    role = Role(args.stage, args.replica)
    compute = Compute.of(args.device, config.precision)
    # On meta: the worker makes only its own stage's parameters real (the runner's weights).
    layout = build_layout(config, build_model(config, meta=True))
    dataset = load_dataset(config)
    expectations = Expectations(config, layout, role)
    # Every frame is delivered before "done" (the last step ends in an all-gather), so a long
    # graceful close buys nothing; 5 s per stage added up in tests.
    transport_config = TransportConfig(
        key_path=args.key, listen_host=args.host, close_timeout_s=1.0, pin_decoded=compute.is_cuda
    )
    with Transport(transport_config, expect=expectations.expect) as transport:
        lines.write({"event": "ready", "peer_id": transport.peer_id, "addrs": transport.addrs})
        start = lines.next_command("start")
        if start is None:
            return 0
        peer_ids, addrs = _peers(start)
        peers = {r: pid for r, pid in peer_ids.items() if r != role}
        runner = PipelineRunner(
            config=config,
            layout=layout,
            role=role,
            dataset=dataset,
            transport=transport,
            peers=peers,
            timeout_s=args.timeout,
            compute=compute,
        )
        # Dial everyone first: a peer must be in our peer store before we can open a stream to
        # it, and its own dial to us may not have happened yet.
        for other in runner.roles:
            if other != role:
                transport.connect(addrs[other])
        runner.start()
        try:
            _train(args, lines, runner, transport)
        finally:
            runner.close()
    return 0


def _train(
    args: argparse.Namespace, lines: _Lines, runner: PipelineRunner, transport: Transport
) -> None:
    """Every step, "done" (the parameters to ``--out``), then wait for quit."""
    for step in range(runner.config.steps):
        if lines.closed:  # the launcher is gone: nobody would read our results
            raise PipelineError("stdin closed: the launcher went away")
        report = runner.run_step(step)
        links = [t.to_json() for t in report.links]
        lines.write({"event": "step", **report.__dict__, "links": links})
    if args.out:
        torch.save(runner.worker.state_dict(), args.out)
    stats = transport.stats()
    lines.write(
        {
            "event": "done",
            "stage": runner.role.stage,
            "replica": runner.role.replica,
            "bytes_out": sum(s.bytes_out for s in stats.values()),
            "refused": runner.mailbox.refused,
            "peak_device_bytes": runner.compute.peak_memory_bytes(),
        }
    )
    lines.next_command("quit")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    configure_logging(args.log_level.upper())
    if args.cpus is not None:
        pin(args.cpus)  # before our threads start: they inherit it
    lines = _Lines()
    try:
        return run(args, lines)
    except (FusionError, OSError, ValueError) as exc:
        logger.debug("stage failed", exc_info=True)
        lines.write({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    except KeyboardInterrupt:
        # Ctrl-C in a terminal reaches every process of the group; the launcher reports it.
        return 130
    except Exception as exc:  # a bug: still tell the launcher why, with the traceback on stderr
        logger.error("stage crashed", exc_info=True)
        lines.write({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
