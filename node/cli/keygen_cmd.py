"""``fusionllm keygen --swarm-key FILE``, and ``--swarm-key``: a private swarm's secret."""

import argparse
from pathlib import Path

from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import SwarmKey, load_swarm_key, write_swarm_key

logger = get_logger(__name__)


def add_parser(commands) -> None:
    keygen = commands.add_parser(
        "keygen",
        help="write a new swarm key for a private swarm",
        description="Writes 32 random bytes in go-libp2p's swarm.key format to FILE (mode "
        "0600, atomically; an existing file is never replaced). Give the same file to every "
        "node of the swarm with `fusionllm node --swarm-key FILE`, over a channel you trust: "
        "only nodes that hold it can connect, publish records or propose plans.",
    )
    keygen.add_argument("--swarm-key", required=True, metavar="FILE", help="where to write it")
    keygen.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    key = write_swarm_key(args.swarm_key)
    print(f"wrote swarm key {Path(args.swarm_key).expanduser()} (digest {key.digest})")
    return 0


_JOIN_HELP = (
    "join a private swarm: only nodes with this key (`fusionllm keygen --swarm-key FILE`) may "
    "connect, publish records or propose plans; the file must be private (chmod 600). "
    "Default: an open swarm"
)


def add_swarm_key_option(parser: argparse.ArgumentParser, *, text: str = _JOIN_HELP) -> None:
    parser.add_argument("--swarm-key", metavar="FILE", help=text)


def swarm_key_of(args: argparse.Namespace) -> SwarmKey | None:
    """The key --swarm-key names (SwarmKeyError for a bad file), or None: an open swarm."""
    if args.swarm_key is None:
        return None
    key = load_swarm_key(args.swarm_key)
    logger.info("private swarm: key %s (digest %s)", args.swarm_key, key.digest)
    return key
