"""Names for hivemind's unix sockets that let a DHT worker's owner find and remove its own.

hivemind's p2pd listens on ``/tmp/hivemind-p2pd-<random>.sock`` and its client on
``/tmp/hivemind-p2pclient-<random>.sock``; hivemind removes the daemon's socket only when it
stops a p2pd that is still running. A daemon that exited on its own (no bootstrap peer
reached) or died with a worker killed by SIGKILL left its socket in /tmp: dozens a day on a
busy machine. The worker's owner (dht/process.py) picks a prefix of its own for each worker,
the worker hands it to hivemind, and the owner removes what matches it once the worker's
process group is gone. The sockets stay in /tmp, where hivemind puts them (a folder of the
worker's own was tried and reverted), and only names carrying the prefix are ever removed.
"""

import contextlib
import glob
import os
import re
import secrets
import stat

from fusionllm.common.logs import get_logger

logger = get_logger(__name__)

_FOLDER = "/tmp"  # hivemind's own (P2P._UNIX_SOCKET_PREFIX)
_PREFIX = re.compile(r"^/tmp/hivemind-fl[0-9a-f]{12}-$")
_KINDS = ("p2pd", "p2pclient")  # hivemind names both sockets <prefix><kind>-<random>.sock
_LISTEN = re.compile(r"^-listen=/unix(/tmp/hivemind-fl[0-9a-f]{12}-)p2pd-[A-Za-z0-9_-]+\.sock$")


def new_prefix() -> str:
    """A fresh prefix for one worker's sockets (6 random bytes: no other worker's)."""
    return f"{_FOLDER}/hivemind-fl{secrets.token_hex(6)}-"


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is one ``new_prefix`` makes, else ValueError (it names what we delete)."""
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise ValueError(f"not a DHT socket prefix: {prefix!r}")
    return prefix


def use_prefix(prefix: str) -> bool:
    """In the worker, before hivemind starts p2pd: name its sockets with ``prefix``. False if
    this hivemind has no such setting (its sockets then keep hivemind's names)."""
    from hivemind.p2p import P2P  # the worker's process only (see dht/worker.py)

    current = getattr(P2P, "_UNIX_SOCKET_PREFIX", None)
    if not isinstance(current, str) or not current.startswith("/unix/"):
        logger.warning("hivemind names its sockets differently (%r): left as they are", current)
        return False
    P2P._UNIX_SOCKET_PREFIX = "/unix" + check_prefix(prefix)
    return True


def remove_sockets(prefix: str) -> list[str]:
    """Remove the unix sockets named with ``prefix`` (call once nothing listens on them);
    the paths removed."""
    removed = []
    for kind in _KINDS:
        for path in glob.glob(glob.escape(check_prefix(prefix) + kind) + "-*.sock"):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.remove(path)
                    removed.append(path)
    return removed


def prefixes_in(command_lines: list[list[str]]) -> list[str]:
    """The socket prefixes of our workers' p2pd among these command lines (p2pd's
    ``-listen=/unix/<socket>``): for a process killer that has no DhtClient to ask, such as a
    test harness that SIGKILLs a node with its DHT worker and p2pd."""
    found = []
    for argv in command_lines:
        for arg in argv:
            match = _LISTEN.match(arg)
            if match and match.group(1) not in found:
                found.append(match.group(1))
    return found
