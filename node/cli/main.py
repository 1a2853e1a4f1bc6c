"""The ``fusionllm`` command line: one module a command, each with ``add_parser`` and ``run``.

- version:   here
- demo_cmd.py:   ``fusionllm demo`` (codecs on a gradient-like tensor)
- train_cmd.py:  ``fusionllm train`` (a local swarm of stage processes)
- node_cmd.py:   ``fusionllm node`` (one node of a swarm)
- swarm_cmd.py:  ``fusionllm swarm`` (N node daemons on this machine)
- status_cmd.py: ``fusionllm status`` (a swarm as its DHT shows it)
- health_cmd.py: ``fusionllm health`` (does the node on this machine answer? docker's check)
- prepare_cmd.py: ``fusionllm prepare`` (text into token shards for ``--data``)
- export_cmd.py: ``fusionllm export`` (nodes' work dirs -> a Hugging Face folder)
- gateway_cmd.py: ``fusionllm gateway`` (an OpenAI-compatible HTTP API over a swarm)
- generate_cmd.py: ``fusionllm generate`` (a prompt continued by a serving swarm)
- keygen_cmd.py: ``fusionllm keygen --swarm-key FILE`` (a private swarm's key), --swarm-key
- options.py:    the run options every training command shares
- config.py:     options from FUSIONLLM_* variables and a TOML --config file
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.node.cli import (
    config,
    demo_cmd,
    export_cmd,
    gateway_cmd,
    generate_cmd,
    health_cmd,
    keygen_cmd,
    node_cmd,
    prepare_cmd,
    status_cmd,
    swarm_cmd,
    train_cmd,
)

logger = get_logger(__name__)


def _version() -> str:
    try:
        return metadata.version("fusionllm")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _torch_version() -> str:
    # From the installed distribution: importing torch costs ~200 MiB and a second.
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def _cmd_version(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"fusionllm": _version(), "torch": _torch_version()}))
    else:
        print(f"fusionllm {_version()} (torch {_torch_version()}, python {sys.version.split()[0]})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionllm",
        description="Peer-to-peer volunteer-computing node: pool GPUs across the internet and "
        "train models together, with no central coordinator.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much to log to stderr (default: %(default)s)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = commands.add_parser("version", help="print the installed version")
    version.add_argument("--json", action="store_true", help="machine-readable output")
    version.set_defaults(handler=_cmd_version)
    for command in (
        demo_cmd,
        train_cmd,
        node_cmd,
        swarm_cmd,
        status_cmd,
        generate_cmd,
        prepare_cmd,
        export_cmd,
        gateway_cmd,
        health_cmd,
        keygen_cmd,
    ):
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        command = config.command_parser(parser, args.command)
        if command is not None and config.is_configurable(command):
            args = config.apply(parser, command, argv, os.environ)
        return args.handler(args)
    except FusionError as exc:
        print(f"fusionllm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
