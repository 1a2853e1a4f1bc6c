"""Training batches as tensors, from a corpus (``fusionllm.data``): the stdlib, a token file or a
prepared directory.

``batch(config, step, micro_batch)`` reads the windows ``Sampler.micro_batch`` names, so any
process (the first stage for the inputs, the last for the targets, a replica for its share)
gets the same batch with no traffic, replicas read disjoint windows, and a run resumed at a
step reads on from where that step's data begins. ``eval_batch`` reads the held-out split.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.data.corpus import (
    Corpus,
    load_corpus,
    load_stdlib,
    load_token_file,
    stdlib_source_files,
)
from fusionllm.data.manifest import DataError
from fusionllm.data.sampler import Sampler

__all__ = ["BatchConfig", "DataError", "TokenDataset", "stdlib_source_files"]


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How batches are drawn; the same on every stage of a run."""

    batch_size: int  # sequences per micro-batch
    seq_len: int
    seed: int = 0
    micro_batches: int = 1  # per step: a step's micro-batches read consecutive samples

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "micro_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [0, 2**63), got {self.seed}")


class TokenDataset:
    """A corpus and the batches its sampler draws from it."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self._samplers: dict[BatchConfig, Sampler] = {}

    @property
    def vocab_size(self) -> int:
        return self.corpus.vocab_size

    @property
    def digest(self) -> str:
        return self.corpus.digest

    @property
    def source(self) -> str:
        return self.corpus.source

    @property
    def tokens(self) -> np.ndarray:
        """Every token as one flat array (a copy when the corpus has several shards)."""
        return self.corpus.store.read(0, len(self.corpus))

    def __len__(self) -> int:
        return len(self.corpus)

    @classmethod
    def from_stdlib(cls, *, max_bytes: int = 4 << 20, root: Path | None = None) -> "TokenDataset":
        return cls(load_stdlib(max_bytes=max_bytes, root=root))

    @classmethod
    def from_file(
        cls, path: Path | str, *, dtype: str = "uint16", vocab_size: int | None = None
    ) -> "TokenDataset":
        return cls(load_token_file(path, dtype=dtype, vocab_size=vocab_size))

    @classmethod
    def load(
        cls,
        path: Path | str | None,
        *,
        dtype: str | None = None,
        vocab_size: int | None = None,
        stdlib_bytes: int = 2 << 20,
    ) -> "TokenDataset":
        """The stdlib (None), a token file or a prepared directory: ``corpus.load_corpus``."""
        corpus = load_corpus(path, dtype=dtype, vocab_size=vocab_size, stdlib_bytes=stdlib_bytes)
        return cls(corpus)

    def sampler(self, config: BatchConfig) -> Sampler:
        if config not in self._samplers:
            self._samplers[config] = Sampler(
                tokens=len(self.corpus),
                seq_len=config.seq_len,
                batch_size=config.batch_size,
                micro_batches=config.micro_batches,
                seed=config.seed,
            )
        return self._samplers[config]

    def samples(self, config: BatchConfig, step: int, micro_batch: int) -> list[int]:
        """The windows (sample ids) micro-batch ``micro_batch`` of ``step`` reads."""
        return self.sampler(config).micro_batch(step, micro_batch).tolist()

    def batch(
        self, config: BatchConfig, step: int, micro_batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), both (B, T) int64; targets are idx shifted by one token."""
        return self._rows(config, self.sampler(config).micro_batch(step, micro_batch))

    def eval_batch(self, config: BatchConfig, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx, targets), both (B, T) int64, from the held-out split."""
        return self._rows(config, self.sampler(config).eval_batch(index))

    def _rows(self, config: BatchConfig, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        sampler, store = self.sampler(config), self.corpus.store
        rows = np.stack([store.read(*sampler.span(int(w))) for w in windows])  # (B, T + 1)
        window_ids = torch.from_numpy(rows.astype(np.int64))  # (B, T + 1)
        return window_ids[:, :-1].contiguous(), window_ids[:, 1:].contiguous()
