"""The node's identity: one Ed25519 private key in a file, created once, reused after.

The file holds the key in libp2p's standard protobuf private-key encoding (go-libp2p's
``MarshalPrivateKey``: Ed25519 data = 32-byte seed + 32-byte public key), so the same file
serves py-libp2p (the data plane) and hivemind's Go daemon (the DHT) and the node has one peer
id everywhere, stable across restarts. py-libp2p itself serializes only the 32-byte seed,
which the Go daemon refuses; such files are read and rewritten in the standard form.
"""

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.ed25519 import create_new_key_pair as new_ed25519_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.pb import crypto_pb2
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
    path.parent.mkdir(parents=True, exist_ok=True)
    if _write_private(path, standard_encoding(key_pair)):
        logger.info("created identity key %s (peer id %s)", path, peer_id_of(key_pair))
    else:
        logger.debug("identity key %s appeared concurrently; using it", path)


def standard_encoding(key_pair: KeyPair) -> bytes:
    """libp2p's canonical PrivateKey protobuf: {Type: Ed25519, Data: seed || public key}."""
    seed = key_pair.private_key.to_bytes()
    public = key_pair.public_key.to_bytes()
    return bytes([0x08, 0x01, 0x12, 64]) + seed + public


def _write_private(path: Path, data: bytes, *, replace: bool = False) -> bool:
    """Write ``data`` to ``path`` with mode 0600; False if it exists (and not ``replace``)."""
    # Write a private temp file, then link it into place: the key is never visible half
    # written or with a looser mode, and two nodes starting at once keep the first key.
    # mkstemp picks a fresh name (O_EXCL, mode 0600): a name made from the pid collides with
    # the one a killed run left behind, since in a container every run is PID 1.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        _fsync_dir(path.parent)  # the new name survives a power cut, not just the bytes
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except Exception as exc:  # protobuf raises assorted types
        raise IdentityError(f"identity key {path} is not a libp2p private key: {exc}") from exc
    if message.key_type != crypto_pb2.KeyType.Ed25519:
        raise IdentityError(f"identity key {path} is not Ed25519; fusionllm uses Ed25519 keys")
    data = bytes(message.data)
    if len(data) not in (32, 64):
        raise IdentityError(f"identity key {path}: Ed25519 data of {len(data)} bytes")
    try:
        private_key = Ed25519PrivateKey.from_bytes(data[:32])
    except Exception as exc:
        raise IdentityError(f"identity key {path} is not a valid Ed25519 key: {exc}") from exc
    key_pair = KeyPair(private_key, private_key.get_public_key())
    if len(data) == 64 and data[32:] != key_pair.public_key.to_bytes():
        raise IdentityError(f"identity key {path}: the public half does not match the seed")
    if len(data) == 32:
        _write_private(path, standard_encoding(key_pair), replace=True)
        logger.info("rewrote identity key %s in libp2p's standard encoding", path)
    return key_pair
