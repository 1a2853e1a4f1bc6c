"""A private swarm's shared secret (``--swarm-key FILE``) and the keys derived from it.

The file is go-libp2p's private-network key format (``ipfs-swarm-key-gen`` writes the same):

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits: 32 random bytes>

The secret never leaves the node and is never used directly: HKDF-SHA256 derives one key per
use, so a leak of one (say the py-libp2p pre-shared key, which that library keeps in memory as
hex) tells nothing of the others:

- ``pnet_psk``: py-libp2p's private network (libp2p/security/pnet): a connection from a node
  without it fails before Noise, so gossip, probes, tensor streams and lane offers (lanes
  are opened only with keys agreed on such a connection) never reach a stranger;
- ``records`` (``tag``/``verify``): HMAC-SHA256 over a DHT record's signed bytes (key,
  subkey, expiry, body): hivemind's DHT has no private network, so a record or plan proposal
  from a node without the secret is refused by the DHT worker's validator (``RecordTags``
  alone goes to the worker) and again on read, and a tag replayed under another key, subkey
  or expiry fails;
- ``records.cipher_key``: AES-256-GCM over every DHT value a member stores (dht/cipher.py),
  derived from the records key with its own label (so the DHT worker, given the records key
  only, opens what it validates): a stranger who reads the DHT learns only that values exist;
- ``digest``: names the swarm in the settings digest, so keyed and open swarms never mix.
"""

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import ConfigError

HEADER = b"/key/swarm/psk/1.0.0/\n/base16/\n"
KEY_BYTES = 32  # what keygen writes, and the least a file may hold
_MAX_KEY_BYTES = 1024
_MAX_FILE_BYTES = len(HEADER) + 2 * _MAX_KEY_BYTES + 2
TAG_BYTES = 32


class SwarmKeyError(ConfigError):
    """A swarm key file that is missing, malformed, too short or not private."""


class RecordTags:
    """HMAC-SHA256 tags under one derived key: what a DHT worker needs of a swarm key."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != 32:
            raise SwarmKeyError("a record tag key must be 32 bytes")
        self._key = key
        self._cipher_key = _derive(key, b"fusionllm/swarm-key/records/cipher/v1")

    @classmethod
    def from_hex(cls, text: str) -> "RecordTags":
        try:
            return cls(bytes.fromhex(text))
        except (TypeError, ValueError):
            raise SwarmKeyError("a record tag key must be 64 hex digits") from None

    def __repr__(self) -> str:
        return "RecordTags(...)"

    @property
    def key_hex(self) -> str:
        """For the DHT worker's config, which travels over its stdin pipe only."""
        return self._key.hex()

    @property
    def cipher_key(self) -> bytes:
        """The key that seals DHT values (dht/cipher.py): derived, never the tag key itself."""
        return self._cipher_key

    def tag(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def verify(self, data: bytes, tag: object) -> bool:
        """Whether ``tag`` (from a peer: any type) is ours over ``data``; constant time."""
        if not isinstance(tag, bytes) or len(tag) != TAG_BYTES:
            return False
        return hmac.compare_digest(self.tag(data), tag)


class SwarmKey:
    """The derived keys of one swarm secret; its repr shows the digest only."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or not KEY_BYTES <= len(secret) <= _MAX_KEY_BYTES:
            raise SwarmKeyError(f"a swarm secret must be {KEY_BYTES}-{_MAX_KEY_BYTES} bytes")
        self.records = RecordTags(_derive(secret, b"fusionllm/swarm-key/records/v1"))
        self._psk = _derive(secret, b"fusionllm/swarm-key/pnet/v1")
        self.digest = _derive(secret, b"fusionllm/swarm-key/id/v1").hex()[:16]

    def __repr__(self) -> str:
        return f"SwarmKey(digest={self.digest})"

    @property
    def pnet_psk(self) -> str:
        """py-libp2p's pre-shared key: 32 bytes as 64 hex digits."""
        return self._psk.hex()

    def tag(self, data: bytes) -> bytes:
        return self.records.tag(data)

    def verify(self, data: bytes, tag: object) -> bool:
        return self.records.verify(data, tag)


def _derive(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def load_swarm_key(path: str | os.PathLike[str]) -> SwarmKey:
    """The key in ``path``; SwarmKeyError for a file that is not a private, regular file of
    go-libp2p's format holding at least 32 bytes."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise SwarmKeyError(f"swarm key {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SwarmKeyError(f"swarm key {path}: not a regular file")
        if info.st_mode & 0o077:
            raise SwarmKeyError(
                f"swarm key {path}: group or others may access it (mode "
                f"{stat.S_IMODE(info.st_mode):03o}); run chmod 600 {path}"
            )
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return SwarmKey(_parse(path, data))


def _parse(path: Path, data: bytes) -> bytes:
    if len(data) > _MAX_FILE_BYTES:
        raise SwarmKeyError(f"swarm key {path}: over {_MAX_FILE_BYTES} bytes")
    if not data.startswith(HEADER):
        raise SwarmKeyError(
            f"swarm key {path}: expected go-libp2p's format ({HEADER!r} then hex); "
            "write one with `fusionllm keygen --swarm-key FILE`"
        )
    text = data[len(HEADER) :].strip()
    try:
        secret = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise SwarmKeyError(f"swarm key {path}: the key is not hex digits") from None
    if len(secret) < KEY_BYTES:
        raise SwarmKeyError(
            f"swarm key {path}: {len(secret)} bytes, too short (at least {KEY_BYTES})"
        )
    if len(secret) > _MAX_KEY_BYTES:
        raise SwarmKeyError(f"swarm key {path}: over {_MAX_KEY_BYTES} bytes")
    return secret


def write_swarm_key(path: str | os.PathLike[str]) -> SwarmKey:
    """A new random key written to ``path`` (mode 0600, atomically); refuses to replace one."""
    path = Path(path).expanduser()
    if path.exists() or path.is_symlink():
        raise SwarmKeyError(f"swarm key {path} exists; not replacing it")
    secret = secrets.token_bytes(KEY_BYTES)
    write_atomic(path, HEADER + secret.hex().encode() + b"\n", mode=0o600)
    return SwarmKey(secret)
