"""The manifest of a directory ``fusionllm prepare`` wrote: its shards, dtype, vocabulary, digest.

A file on disk is untrusted input: its size is bounded before it is parsed, every field is
type-checked, and a shard name may not leave the directory.
"""

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = "fusionllm-tokens"
VERSION = 1
TOKEN_DTYPES = {"uint16": 2, "uint32": 4}
MAX_MANIFEST_BYTES = 16 << 20
MAX_SHARDS = 100_000
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}\.bin$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class DataError(ConfigError):
    """No usable training data: unreadable, malformed, a token out of range, too little of it."""


@dataclass(frozen=True, kw_only=True)
class Shard:
    file: str  # a name inside the manifest's directory
    tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or not _SHARD_NAME.match(self.file):
            raise DataError(f"bad shard file name {self.file!r}")
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise DataError(f"shard {self.file}: tokens must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    dtype: str  # uint16 or uint32, little-endian, no header
    vocab_size: int
    tokens: int  # over all shards
    digest: str  # corpus_digest of the shards' tokens, in order
    shards: tuple[Shard, ...]
    tokenizer: str = "bytes"  # "bytes", or "tokenizer.json sha256:<hex>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        if self.dtype not in TOKEN_DTYPES:
            raise DataError(f"dtype must be one of {sorted(TOKEN_DTYPES)}, got {self.dtype!r}")
        limit = 1 << (8 * TOKEN_DTYPES[self.dtype])
        if not isinstance(self.vocab_size, int) or not 2 <= self.vocab_size <= limit:
            raise DataError(f"vocab_size must be in [2, {limit}] for {self.dtype}")
        if not isinstance(self.digest, str) or not _DIGEST.match(self.digest):
            raise DataError("digest must be 64 lowercase hex digits")
        if not self.shards or len(self.shards) > MAX_SHARDS:
            raise DataError(f"a manifest lists 1 to {MAX_SHARDS} shards, got {len(self.shards)}")
        if len({s.file for s in self.shards}) != len(self.shards):
            raise DataError("a shard is listed twice")
        if self.tokens != sum(s.tokens for s in self.shards):
            raise DataError(f"tokens {self.tokens} is not the sum of the shards' tokens")
        if not isinstance(self.tokenizer, str) or len(self.tokenizer) > 200:
            raise DataError("tokenizer must be a short string")

    @property
    def itemsize(self) -> int:
        return TOKEN_DTYPES[self.dtype]

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return json.dumps(body, indent=1)

    def write(self, directory: Path) -> Path:
        return write_atomic(Path(directory) / MANIFEST, self.to_json().encode())


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory``, checked field by field (not its shards: see corpus.py)."""
    path = Path(directory) / MANIFEST
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise DataError(f"{directory} is not a prepared data directory: {exc}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DataError(f"{path} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise DataError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DataError(f"{path} is not a {FORMAT} manifest")
    if body.get("version") != VERSION:
        raise DataError(f"{path}: version {body.get('version')!r}, this fusionllm reads {VERSION}")
    shards = body.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise DataError(f"{path}: shards must be a list of objects")
    fields = {k: v for k, v in body.items() if k not in ("format", "version", "shards")}
    try:
        return Manifest(**fields, shards=tuple(Shard(**s) for s in shards))
    except TypeError as exc:
        raise DataError(f"{path}: {exc}") from exc
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from exc
