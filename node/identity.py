"""The node's identity: one Ed25519 private key in a file, created once, reused after.

The file holds the key in libp2p's protobuf private-key encoding (what go-libp2p's
``MarshalPrivateKey`` and py-libp2p's ``save_identity`` write), so the same file can serve any
libp2p stack that reads that format and the peer id stays the same across restarts.
"""

import contextlib
import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.ed25519 import create_new_key_pair as new_ed25519_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import IdentityError

logger = get_logger(__name__)

_MAX_KEY_FILE_BYTES = 4096


def load_or_create_identity(path: str | os.PathLike[str]) -> KeyPair:
    """The key pair in ``path``; a new one is written there (mode 0600) if it does not exist.

    Refuses (IdentityError) a file that group or others may read or write, like ssh does:
    whoever reads the key can impersonate the node.
    """
    path = Path(path)
    if not path.exists():
        _create(path)
    return _load(path)


def peer_id_of(key_pair: KeyPair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()


def _create(path: Path) -> None:
    key_pair = new_ed25519_key_pair()
    data = key_pair.private_key.serialize()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write a private temp file, then link it into place: the key is never visible half
    # written or with a looser mode, and two nodes starting at once keep the first key.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(tmp, path)
            logger.info("created identity key %s (peer id %s)", path, peer_id_of(key_pair))
        except FileExistsError:
            logger.debug("identity key %s appeared concurrently; using it", path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _load(path: Path) -> KeyPair:
    try:
        info = path.stat()
    except OSError as exc:
        raise IdentityError(f"cannot stat identity key {path}: {exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise IdentityError(f"identity key {path} is not a regular file")
    if info.st_mode & 0o077:
        raise IdentityError(
            f"identity key {path} has mode {stat.S_IMODE(info.st_mode):o}; group/others may "
            f"access it. Run: chmod 600 {path}"
        )
    if info.st_size > _MAX_KEY_FILE_BYTES:
        raise IdentityError(f"identity key {path} is {info.st_size} bytes; not a key file")
    try:
        private_key = deserialize_private_key(path.read_bytes())
    except Exception as exc:  # protobuf and key parsers raise assorted types
        raise IdentityError(f"identity key {path} is not a libp2p private key: {exc}") from exc
    if not isinstance(private_key, Ed25519PrivateKey):
        raise IdentityError(
            f"identity key {path} is {type(private_key).__name__}; fusionllm uses Ed25519"
        )
    return KeyPair(private_key, private_key.get_public_key())
