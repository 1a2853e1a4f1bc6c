"""A training corpus: its tokens, vocabulary and digest, from any of the three sources a node reads.

- the Python standard library's ``*.py`` files (bytes, vocabulary 256), walked in sorted path
  order (site-packages left out) up to ``max_bytes``: the default, nothing to download;
- a nanoGPT-style flat file of little-endian uint16/uint32 token ids, memory-mapped;
- a directory ``fusionllm prepare`` wrote: shards and a manifest (manifest.py).

Every source is read through once on load: the ids are checked against the vocabulary and the
digest is computed from the tokens themselves (a manifest's stated digest must match it). The
digest joins the swarm's settings (``RunSpec.data_digest``): two nodes on different text, a
different Python's stdlib say, are never planned together.
"""

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionllm.common.logs import get_logger
from fusionllm.data.manifest import TOKEN_DTYPES, DataError, read_manifest

logger = get_logger(__name__)

STDLIB_VOCAB = 256
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SCAN_TOKENS = 1 << 22  # tokens hashed and range-checked at a time (bounded memory)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The stdlib's ``*.py`` files in a depth-first walk with sorted names (no site-packages)."""
    root = stdlib_root() if root is None else Path(root)
    found: list[Path] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        found.extend(Path(directory, name) for name in sorted(filenames) if name.endswith(".py"))
    return found


class CorpusHasher:
    """sha256 over the dtype and the little-endian token bytes, in order: a flat file and the
    shards of a prepared directory holding the same tokens in the same dtype digest alike."""

    def __init__(self, dtype: str) -> None:
        self._h = hashlib.sha256(f"fusionllm-corpus-v1\n{dtype}\n".encode())

    def update(self, tokens: np.ndarray) -> None:
        self._h.update(np.ascontiguousarray(tokens))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class TokenStore:
    """One or more flat token arrays (shards) read as one sequence."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        if not parts or any(p.ndim != 1 or len(p) == 0 for p in parts):
            raise DataError("a token store needs one or more non-empty flat arrays")
        self.parts = parts
        self._ends = np.cumsum([len(p) for p in parts])  # (P,) exclusive end of each part

    def __len__(self) -> int:
        return int(self._ends[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as one array (a copy where the range spans shards)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside [0, {len(self)})")
        if start == stop:
            return self.parts[0][:0]
        first = int(np.searchsorted(self._ends, start, side="right"))
        pieces, at = [], start
        for i in range(first, len(self.parts)):
            if at >= stop:
                break
            begin = 0 if i == 0 else int(self._ends[i - 1])
            take = self.parts[i][at - begin : min(stop, int(self._ends[i])) - begin]
            pieces.append(take)
            at += len(take)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@dataclass(frozen=True)
class Corpus:
    store: TokenStore
    vocab_size: int
    digest: str  # 64 hex digits (CorpusHasher)
    dtype: str
    source: str  # where it came from, for messages

    def __len__(self) -> int:
        return len(self.store)


def load_corpus(
    path: Path | str | None,
    *,
    dtype: str | None = None,
    vocab_size: int | None = None,
    stdlib_bytes: int = 2 << 20,
) -> Corpus:
    """The stdlib source (``path`` None), a prepared directory or a flat token file.

    A flat file's dtype defaults to uint16 and its vocabulary to its largest id + 1; a
    directory's come from its manifest (a flag that disagrees is an error).
    """
    if path is None:
        if vocab_size not in (None, STDLIB_VOCAB):
            raise DataError(f"the stdlib text is bytes: vocab_size must be 256, not {vocab_size}")
        return load_stdlib(max_bytes=stdlib_bytes)
    path = Path(path)
    if path.is_dir():
        return load_prepared(path, dtype=dtype, vocab_size=vocab_size)
    return load_token_file(path, dtype=dtype or "uint16", vocab_size=vocab_size)


def load_stdlib(*, max_bytes: int = 2 << 20, root: Path | None = None) -> Corpus:
    """Bytes of the stdlib source files, in order, until ``max_bytes`` (vocabulary 256)."""
    if max_bytes < 2:
        raise DataError(f"max_bytes must be >= 2, got {max_bytes}")
    root = stdlib_root() if root is None else Path(root)
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            logger.debug("skipping unreadable %s", path, exc_info=True)
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 2:
        raise DataError(f"no Python source files found under {root}")
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)  # (N,)
    hasher = CorpusHasher("uint8")
    hasher.update(tokens)
    logger.debug("stdlib text: %d bytes from %d files under %s", total, len(chunks), root)
    return Corpus(TokenStore([tokens]), STDLIB_VOCAB, hasher.hexdigest(), "uint8", f"stdlib:{root}")


def _memmap(path: Path, dtype: str, expected_tokens: int | None = None) -> np.ndarray:
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"token dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    itemsize = TOKEN_DTYPES[dtype]
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(f"cannot read token file {path}: {exc}") from exc
    if size == 0 or size % itemsize:
        raise DataError(
            f"token file {path} has {size} bytes, not a positive multiple of {itemsize} ({dtype})"
        )
    if expected_tokens is not None and size != expected_tokens * itemsize:
        raise DataError(
            f"{path} holds {size // itemsize} tokens, its manifest says {expected_tokens}"
        )
    try:
        return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot map token file {path}: {exc}") from exc


def _scan(parts: list[np.ndarray], dtype: str) -> tuple[str, int]:
    """(digest, largest id) of the tokens, read a bounded chunk at a time."""
    hasher, top = CorpusHasher(dtype), 0
    for part in parts:
        for begin in range(0, len(part), _SCAN_TOKENS):
            chunk = part[begin : begin + _SCAN_TOKENS]
            hasher.update(chunk)
            top = max(top, int(chunk.max()))
    return hasher.hexdigest(), top


def _check_vocab(source: str, top: int, vocab_size: int, dtype: str) -> None:
    limit = 1 << (8 * TOKEN_DTYPES[dtype])
    if not 2 <= vocab_size <= limit:
        raise DataError(f"vocab_size must be in [2, {limit}] for {dtype}, got {vocab_size}")
    if top >= vocab_size:
        raise DataError(f"{source} holds token id {top} >= vocab_size {vocab_size}")


def load_token_file(path: Path | str, *, dtype: str = "uint16", vocab_size: int | None) -> Corpus:
    """A nanoGPT-style token file: raw little-endian uint16 or uint32 ids, no header."""
    path = Path(path)
    tokens = _memmap(path, dtype)
    digest, top = _scan([tokens], dtype)
    vocab = max(top + 1, 2) if vocab_size is None else vocab_size
    _check_vocab(str(path), top, vocab, dtype)
    return Corpus(TokenStore([tokens]), vocab, digest, dtype, str(path))


def load_prepared(
    directory: Path | str, *, dtype: str | None = None, vocab_size: int | None = None
) -> Corpus:
    """The shards of a ``fusionllm prepare`` directory, checked against its manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if dtype is not None and dtype != manifest.dtype:
        raise DataError(f"{directory} holds {manifest.dtype} tokens, not {dtype}")
    if vocab_size is not None and vocab_size != manifest.vocab_size:
        raise DataError(f"{directory} has vocab_size {manifest.vocab_size}, not {vocab_size}")
    parts = [_memmap(directory / s.file, manifest.dtype, s.tokens) for s in manifest.shards]
    digest, top = _scan(parts, manifest.dtype)
    if digest != manifest.digest:
        raise DataError(f"{directory}: the shards' digest does not match the manifest's")
    _check_vocab(str(directory), top, manifest.vocab_size, manifest.dtype)
    return Corpus(TokenStore(parts), manifest.vocab_size, digest, manifest.dtype, str(directory))
