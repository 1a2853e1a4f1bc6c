"""Training tokens with nothing to download: the Python standard library's source, or a token file.

- ``TokenDataset.from_stdlib``: the bytes of the stdlib's ``*.py`` files (vocabulary 256), walked
  in sorted path order (site-packages left out) up to ``max_bytes``, so every node on the same
  Python sees the same text.
- ``TokenDataset.from_file``: a nanoGPT-style flat file of uint16/uint32 token ids, memory-mapped.

``batch(step, micro_batch)`` draws ``batch_size`` random windows of ``seq_len + 1`` tokens from a
generator seeded by (seed, step, micro_batch) alone, so any process (the first stage for the
inputs, the last for the targets, a replica for its share) gets the same batch with no traffic.
"""

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger

logger = get_logger(__name__)

_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class DataError(ConfigError):
    """No usable training text: nothing found, a malformed token file, a token out of range."""


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How batches are drawn; the same on every stage of a run."""

    batch_size: int  # sequences per micro-batch
    seq_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {self.seq_len}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The stdlib's ``*.py`` files in a depth-first walk with sorted names (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    found: list[Path] = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        found.extend(Path(directory, name) for name in sorted(filenames) if name.endswith(".py"))
    return found


class TokenDataset:
    """A flat array of token ids and the batches drawn from it."""

    def __init__(self, tokens: np.ndarray, *, vocab_size: int, source: str) -> None:
        if tokens.ndim != 1:
            raise DataError(f"tokens must be a flat array, got shape {tokens.shape}")
        if vocab_size < 2:
            raise DataError(f"vocab_size must be >= 2, got {vocab_size}")
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.source = source

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_stdlib(cls, *, max_bytes: int = 4 << 20, root: Path | None = None) -> "TokenDataset":
        """Bytes of the stdlib source files, in order, until ``max_bytes`` (vocabulary 256)."""
        if max_bytes < 2:
            raise ConfigError(f"max_bytes must be >= 2, got {max_bytes}")
        root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
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
        tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        logger.debug("stdlib text: %d bytes from %d files under %s", total, len(chunks), root)
        return cls(tokens, vocab_size=256, source=f"stdlib:{root}")

    @classmethod
    def from_file(
        cls, path: Path | str, *, dtype: str = "uint16", vocab_size: int | None = None
    ) -> "TokenDataset":
        """A nanoGPT-style token file: raw little-endian uint16 or uint32 ids, no header.

        ``vocab_size`` defaults to the dtype's range; every batch is checked against it.
        """
        if dtype not in _TOKEN_DTYPES:
            raise DataError(f"token dtype must be one of {sorted(_TOKEN_DTYPES)}, got {dtype!r}")
        np_dtype = np.dtype(_TOKEN_DTYPES[dtype]).newbyteorder("<")
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise DataError(f"cannot read token file {path}: {exc}") from exc
        if size == 0 or size % np_dtype.itemsize:
            raise DataError(
                f"token file {path} has {size} bytes, not a positive multiple of "
                f"{np_dtype.itemsize} ({dtype})"
            )
        limit = 1 << (8 * np_dtype.itemsize)
        vocab = limit if vocab_size is None else vocab_size
        if not 2 <= vocab <= limit:
            raise DataError(f"vocab_size must be in [2, {limit}] for {dtype}, got {vocab}")
        tokens = np.memmap(path, dtype=np_dtype, mode="r")
        return cls(tokens, vocab_size=vocab, source=str(path))

    def batch(
        self, config: BatchConfig, step: int, micro_batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), both (B, T) int64; targets are idx shifted by one token."""
        if step < 0 or micro_batch < 0:
            raise ValueError(f"step and micro_batch must be >= 0, got {step}, {micro_batch}")
        window = config.seq_len + 1
        if len(self.tokens) < window:
            raise DataError(
                f"{self.source} holds {len(self.tokens)} tokens, fewer than seq_len + 1 = {window}"
            )
        # SeedSequence mixes the three numbers well: nearby seeds/steps give unrelated streams.
        state = np.random.SeedSequence((config.seed, step, micro_batch)).generate_state(2)
        generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        starts = torch.randint(
            0, len(self.tokens) - window + 1, (config.batch_size,), generator=generator
        )
        rows = np.stack([self.tokens[s : s + window] for s in starts.tolist()])  # (B, T + 1)
        if rows.max() >= self.vocab_size:
            raise DataError(
                f"{self.source} holds token id {int(rows.max())} >= vocab_size {self.vocab_size}"
            )
        window_ids = torch.from_numpy(rows.astype(np.int64))  # (B, T + 1)
        return window_ids[:, :-1].contiguous(), window_ids[:, 1:].contiguous()
