"""``prepare``: text and ``.jsonl`` files into token shards and a manifest, streamed.

Input is read ``chunk_bytes`` at a time (a text file cut after its last newline in the chunk,
a ``.jsonl`` file a line at a time, each line an object with a string ``text``), tokenized,
and appended to a shard buffer that is written out, atomically, every ``shard_tokens``
tokens: memory stays at about one shard and one chunk whatever the input size. Tokens are
bytes (vocabulary 256) by default, or a local ``tokenizer.json`` (the ``tokenizers``
package; nothing is downloaded), uint16 while the vocabulary fits, else uint32. With a
tokenizer that has an end-of-text token, one goes after every document (a file, or a line);
bytes get a newline there.

Inputs are checked before anything is written; an input that fails later (not UTF-8 where a
tokenizer needs text, a malformed line) stops the run and removes the shards it wrote, and
the manifest is written last: a directory with a manifest is whole.
"""

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionllm.common.atomic import write_atomic
from fusionllm.common.logs import get_logger
from fusionllm.data.corpus import CorpusHasher
from fusionllm.data.manifest import MANIFEST, DataError, Manifest, Shard

logger = get_logger(__name__)

END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
MAX_LINE_BYTES = 64 << 20  # one .jsonl record


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    inputs: tuple[Path, ...]
    out: Path
    tokenizer: Path | None = None  # tokenizer.json, or a directory holding one; None: bytes
    shard_tokens: int = 1 << 24
    chunk_bytes: int = 1 << 20  # text read and tokenized at a time

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(Path(p) for p in self.inputs))
        object.__setattr__(self, "out", Path(self.out))
        if not self.inputs:
            raise DataError("prepare needs at least one input file")
        for name in ("shard_tokens", "chunk_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DataError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")


class _Bytes:
    """Byte-level tokens: a document's UTF-8 (or raw) bytes, vocabulary 256; a newline ends a
    document (``.jsonl`` records would otherwise run into each other)."""

    vocab_size = 256
    name = "bytes"
    needs_text = False

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    def end_of_text(self) -> np.ndarray:
        return np.asarray([ord("\n")], dtype=np.int64)


class _HFTokenizer:
    needs_text = True

    def __init__(self, path: Path) -> None:
        import hashlib

        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            raw = file.read_bytes()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read tokenizer {file}: {exc}") from exc
        except Exception as exc:  # tokenizers raises its own Exception on a malformed file
            raise DataError(f"{file} is not a tokenizers tokenizer.json: {exc}") from exc
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.name = f"tokenizer.json sha256:{hashlib.sha256(raw).hexdigest()}"
        eot = [self._tok.token_to_id(t) for t in END_OF_TEXT]
        self._eot = next((i for i in eot if i is not None), None)

    def encode(self, text: bytes) -> np.ndarray:
        return np.asarray(self._tok.encode(text.decode("utf-8")).ids, dtype=np.int64)

    def end_of_text(self) -> np.ndarray:
        return np.asarray([] if self._eot is None else [self._eot], dtype=np.int64)


def check_inputs(config: PrepareConfig) -> int:
    """Total input bytes; an input that is missing, not a file or unreadable is refused now."""
    total = 0
    for path in config.inputs:
        if not path.is_file():
            raise DataError(f"input {path} is not a readable file")
        try:
            with path.open("rb") as file:
                file.read(1)
        except OSError as exc:
            raise DataError(f"cannot read input {path}: {exc}") from exc
        total += path.stat().st_size
    out = config.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty directory")
    return total


def _documents(path: Path, chunk_bytes: int) -> Iterator[tuple[bytes, int, bool]]:
    """(text, input bytes consumed, whether a document ends here), a bounded piece at a time."""
    with path.open("rb") as file:
        if path.suffix == ".jsonl":
            for number, line in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b"")):
                yield _jsonl_text(path, number + 1, line), len(line), True
            return
        carry = b""
        while chunk := file.read(chunk_bytes):
            piece = carry + chunk
            cut = piece.rfind(b"\n") + 1 or len(piece)  # whole lines where the chunk has one
            carry = piece[cut:]
            yield piece[:cut], len(chunk), False
        yield carry, 0, True


def _jsonl_text(path: Path, number: int, line: bytes) -> bytes:
    if len(line) > MAX_LINE_BYTES:
        raise DataError(f"{path}:{number}: a line over {MAX_LINE_BYTES} bytes")
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{path}:{number}: not JSON: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f"{path}:{number}: expected an object with a string 'text' field")
    return record["text"].encode("utf-8")


class _ShardWriter:
    def __init__(self, out: Path, dtype: str, shard_tokens: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.hasher = CorpusHasher(dtype)
        self.shards: list[Shard] = []
        self._pending: list[np.ndarray] = []
        self._count = 0

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = tokens[: self.shard_tokens - self._count]
            self._pending.append(take.astype(self.dtype))
            self._count += len(take)
            tokens = tokens[len(take) :]
            if self._count == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self._count:
            return
        shard = np.concatenate(self._pending).astype(np.dtype(self.dtype).newbyteorder("<"))
        name = f"shard-{len(self.shards):05d}.bin"
        write_atomic(self.out / name, shard.tobytes())
        self.hasher.update(shard)
        self.shards.append(Shard(file=name, tokens=len(shard)))
        self._pending, self._count = [], 0

    def remove(self) -> None:
        for shard in self.shards:
            (self.out / shard.file).unlink(missing_ok=True)


def _encode(tokenizer: _Bytes | _HFTokenizer, path: Path, text: bytes) -> np.ndarray:
    try:
        return tokenizer.encode(text)
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start} of a chunk); "
            "byte-level prepare (no --tokenizer) takes any bytes"
        ) from exc


def prepare(config: PrepareConfig, progress: Callable[[int], None] = lambda n: None) -> Manifest:
    """Tokenize ``config.inputs`` into shards and a manifest in ``config.out``; ``progress``
    hears the input bytes consumed as they are."""
    total = check_inputs(config)
    tokenizer = _Bytes() if config.tokenizer is None else _HFTokenizer(config.tokenizer)
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    logger.info("preparing %d inputs (%d bytes) with %s, vocabulary %d, as %s", len(config.inputs),
                total, tokenizer.name[:40], tokenizer.vocab_size, dtype)  # fmt: skip
    config.out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(config.out, dtype, config.shard_tokens)
    try:
        for path in config.inputs:
            for text, consumed, ends in _documents(path, config.chunk_bytes):
                writer.add(_encode(tokenizer, path, text))
                if ends:
                    writer.add(tokenizer.end_of_text())
                progress(consumed)
        writer.flush()
        if not writer.shards:
            raise DataError(f"the inputs hold no text: {[str(p) for p in config.inputs]}")
        manifest = Manifest(
            dtype=dtype,
            vocab_size=tokenizer.vocab_size,
            tokens=sum(s.tokens for s in writer.shards),
            digest=writer.hasher.hexdigest(),
            shards=tuple(writer.shards),
            tokenizer=tokenizer.name,
        )
        manifest.write(config.out)
    except BaseException:
        writer.remove()
        (config.out / MANIFEST).unlink(missing_ok=True)
        raise
    return manifest
