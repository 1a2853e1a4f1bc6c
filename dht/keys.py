"""DHT key names of one swarm. Keys are plain strings; hivemind hashes them into key ids."""

import re

from fusionllm.common.errors import ConfigError

_SWARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_swarm_name(name: str) -> str:
    if not isinstance(name, str) or not _SWARM_NAME.fullmatch(name):
        raise ConfigError(
            f"swarm name must be 1-64 letters, digits, '.', '_' or '-' (not first), got {name!r}"
        )
    return name


def nodes_key(swarm: str) -> str:
    """Where every live node keeps its NodeInfo (subkey = its peer id)."""
    return f"fusionllm/{check_swarm_name(swarm)}/nodes"


def plans_key(swarm: str, epoch: int) -> str:
    """Where the plan proposals of ``epoch`` go (subkey = the proposer's peer id)."""
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:  # "plans/True"
        raise ConfigError(f"epoch must be a non-negative int, got {epoch!r}")
    return f"fusionllm/{check_swarm_name(swarm)}/plans/{epoch}"
