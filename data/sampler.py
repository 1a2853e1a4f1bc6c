"""Which windows of the corpus a step reads: a pure function of (corpus length, batch, seed, step).

The corpus is cut into windows of ``seq_len + 1`` tokens that overlap by one (window ``i`` is
tokens ``[i * T, i * T + T + 1)``: every token is a target once). The last 1% of the windows
(``HELD_OUT_FRACTION``; none below 100 windows) are held out for validation; the rest are read
in a seeded pseudo-random order, a new order each pass (epoch), without replacement.

The run's position in that order is a cursor of samples read: step ``s`` reads positions
``[s * G, (s + 1) * G)`` for a global batch of ``G`` sequences, micro-batch ``m`` the ``B`` of
them from ``(s * M + m) * B``. Every process computes its micro-batches' windows with no
traffic; replicas own distinct micro-batches, so they read disjoint windows; a run resumed at
step ``s`` (a checkpoint, a re-plan) reads from position ``s * G`` on: nothing repeated or
skipped in the trajectory that counts.

The order is a keyed Feistel permutation of ``[0, N)`` with cycle walking: O(1) memory for any
corpus size, the same on every machine (numpy integer arithmetic only).
"""

import functools
from dataclasses import dataclass

import numpy as np

from fusionllm.data.manifest import DataError

HELD_OUT_FRACTION = 100  # one window in this many is held out (the corpus's tail)
_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << np.uint64(half)) | right


def permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of [0, n) applied to ``x`` (every element < n)."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2  # two equal halves
    y = _feistel(x.astype(np.uint64), bits // 2, keys)
    outside = y >= n
    while outside.any():  # cycle walking: x's cycle under the bijection re-enters [0, n)
        y[outside] = _feistel(y[outside], bits // 2, keys)
        outside = y >= n
    return y.astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class Sampler:
    tokens: int  # the corpus length
    seq_len: int
    batch_size: int  # sequences per micro-batch
    micro_batches: int  # per step
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "seq_len", "batch_size", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DataError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise DataError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.train_windows < self.global_batch:
            raise DataError(
                f"{self.tokens} tokens make {self.train_windows} training windows of "
                f"{self.seq_len} + 1 tokens, fewer than one step's {self.global_batch} "
                f"sequences (need about {(self.global_batch + 1) * self.seq_len + 1} tokens)"
            )

    @property
    def windows(self) -> int:
        return (self.tokens - 1) // self.seq_len

    @property
    def held_out(self) -> int:
        return self.windows // HELD_OUT_FRACTION

    @property
    def train_windows(self) -> int:
        return self.windows - self.held_out

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.micro_batches

    def position(self, step: int) -> int:
        """Samples the run has read before ``step``: the cursor a checkpoint records."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step * self.global_batch

    def order(self, positions: np.ndarray) -> np.ndarray:
        """The training windows at these positions of the (endless, epoch after epoch) order."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.min() < 0:
            raise ValueError("positions must be >= 0")
        epochs, within = np.divmod(positions, self.train_windows)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            keys = np.random.SeedSequence((self.seed, int(epoch))).generate_state(
                _ROUNDS, dtype=np.uint64
            )
            chosen = epochs == epoch
            out[chosen] = permute(within[chosen], self.train_windows, keys)
        return out

    def micro_batch(self, step: int, micro_batch: int) -> np.ndarray:
        """(B,) the windows micro-batch ``micro_batch`` of ``step`` reads: positions
        ``(step * M + micro_batch) * B`` on, as ``order`` maps them."""
        if step < 0 or not 0 <= micro_batch < self.micro_batches:
            raise ValueError(
                f"need step >= 0 and micro_batch in [0, {self.micro_batches}), "
                f"got {step}, {micro_batch}"
            )
        first = micro_batch * self.batch_size
        return _step_windows(self, step)[first : first + self.batch_size].copy()

    def eval_batch(self, index: int) -> np.ndarray:
        """(B,) held-out windows for evaluation batch ``index`` (cycling through the split)."""
        if self.held_out < self.batch_size:
            raise DataError(
                f"{self.windows} windows hold out {self.held_out} for validation, fewer than "
                f"a micro-batch of {self.batch_size}: give more data to evaluate"
            )
        offsets = (index * self.batch_size + np.arange(self.batch_size)) % self.held_out
        return self.train_windows + offsets

    def span(self, window: int) -> tuple[int, int]:
        """Token range [start, stop) of a window (seq_len + 1 tokens)."""
        return window * self.seq_len, window * self.seq_len + self.seq_len + 1


@functools.lru_cache(maxsize=8)
def _step_windows(sampler: Sampler, step: int) -> np.ndarray:
    """(G,) every window ``step`` reads, in one ``order`` call: a stage asks for each of its
    micro-batches twice (inputs, and the samples its step reports), and each call's cost is
    numpy's per-operation overhead on a few elements (~0.35 ms at one core), not the
    elements: 8 calls cost a 0.45-core trainer of topology B ~6 ms of its ~0.12 s steps
    (py-spy, session 20). ``order`` is elementwise, so a slice is the micro-batch's."""
    first = step * sampler.global_batch
    windows = sampler.order(np.arange(first, first + sampler.global_batch))
    windows.flags.writeable = False
    return windows
