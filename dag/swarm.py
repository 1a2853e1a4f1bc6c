"""The swarm as the planner sees it: peers, their devices and a sparse, asymmetric link table.

Each peer measures only a bounded sample of others, so most pairs are unmeasured; an unmeasured
link i -> j is estimated as min(uplink_i, downlink_j) with the mean of the two peers' typical
RTTs. The table is canonical (peers sorted by id, links by (src, dst)) so that the same snapshot
gives the same arrays, and so the same plan, whatever order it arrived in.
"""

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, LinkProfile

DENSE_MATRIX_LIMIT = 2048


@dataclass(frozen=True, kw_only=True)
class Peer:
    """One node: its device and its access link (used only to estimate unmeasured links)."""

    peer_id: str
    device: DeviceProfile
    uplink: float  # bytes/s
    downlink: float  # bytes/s
    rtt: float = 0.05  # s, typical round trip to other peers

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ConfigError("peer_id must be non-empty")
        for name in ("uplink", "downlink"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"peer {self.peer_id}: {name} must be > 0, got {value}")
        if not (math.isfinite(self.rtt) and self.rtt >= 0):
            raise ConfigError(f"peer {self.peer_id}: rtt must be >= 0, got {self.rtt}")


class Swarm:
    """Peers (sorted by id) and the measured links between them as parallel arrays.

    Build with ``from_links`` (a dict, for tests and small swarms) or ``from_arrays`` (indices
    into the given peer list, for generated swarms of thousands of peers).
    """

    def __init__(
        self,
        peers: Sequence[Peer],
        src: np.ndarray,
        dst: np.ndarray,
        bandwidth: np.ndarray,
        rtt: np.ndarray,
    ) -> None:
        if not peers:
            raise ConfigError("a swarm needs at least one peer")
        order = sorted(range(len(peers)), key=lambda i: peers[i].peer_id)
        self.peers: tuple[Peer, ...] = tuple(peers[i] for i in order)
        ids = [p.peer_id for p in self.peers]
        duplicates = sorted({a for a, b in itertools.pairwise(ids) if a == b})
        if duplicates:
            raise ConfigError(f"duplicate peer ids {duplicates[:5]}")
        n = len(self.peers)
        new_index = np.empty(n, dtype=np.int64)
        new_index[np.asarray(order, dtype=np.int64)] = np.arange(n, dtype=np.int64)
        src, dst, bandwidth, rtt = _checked_links(n, src, dst, bandwidth, rtt)
        src, dst = new_index[src], new_index[dst]
        key = src * n + dst
        by_key = np.argsort(key, kind="stable")
        key = key[by_key]
        if key.size and np.any(key[1:] == key[:-1]):
            raise ConfigError("a directed link is given twice")
        self.n = n
        self.src = src[by_key]
        self.dst = dst[by_key]
        self.bandwidth = bandwidth[by_key]
        self.rtt = rtt[by_key]
        self._key = key
        self.uplink = np.array([p.uplink for p in self.peers])
        self.downlink = np.array([p.downlink for p in self.peers])
        self.peer_rtt = np.array([p.rtt for p in self.peers])
        self._index = {pid: i for i, pid in enumerate(ids)}
        # Up to DENSE_MATRIX_LIMIT peers every lookup is a plain index into full matrices
        # (2 x 32 MiB at the limit); above it, a binary search in the sorted link keys.
        self._dense_bw: np.ndarray | None = None
        self._dense_rtt: np.ndarray | None = None
        if n <= DENSE_MATRIX_LIMIT:
            self._dense_bw = np.minimum.outer(self.uplink, self.downlink)
            self._dense_rtt = (self.peer_rtt[:, None] + self.peer_rtt[None, :]) / 2
            self._dense_bw[self.src, self.dst] = self.bandwidth
            self._dense_rtt[self.src, self.dst] = self.rtt
        # Both directions of every measured link: what clustering and pairing compare.
        back_bw, back_rtt = self.link_arrays(self.dst, self.src)
        self.symmetric_bandwidth = np.minimum(self.bandwidth, back_bw)
        self.symmetric_rtt = np.maximum(self.rtt, back_rtt)

    @classmethod
    def from_links(
        cls, peers: Sequence[Peer], links: Mapping[tuple[str, str], LinkProfile] | None = None
    ) -> "Swarm":
        """``links[(a, b)]`` is the measured direction a -> b; absent pairs are estimated."""
        position = {p.peer_id: i for i, p in enumerate(peers)}
        items = sorted((links or {}).items())
        unknown = sorted({x for (a, b), _ in items for x in (a, b) if x not in position})
        if unknown:
            raise ConfigError(f"links name unknown peers {unknown[:5]}")
        return cls(
            peers,
            np.array([position[a] for (a, _), _ in items], dtype=np.int64),
            np.array([position[b] for (_, b), _ in items], dtype=np.int64),
            np.array([link.bandwidth for _, link in items], dtype=np.float64),
            np.array([link.rtt for _, link in items], dtype=np.float64),
        )

    @classmethod
    def from_arrays(
        cls,
        peers: Sequence[Peer],
        src: np.ndarray,
        dst: np.ndarray,
        bandwidth: np.ndarray,
        rtt: np.ndarray,
    ) -> "Swarm":
        return cls(peers, src, dst, bandwidth, rtt)

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(p.peer_id for p in self.peers)

    def index(self, peer_id: str) -> int:
        return self._index[peer_id]

    def link(self, i: int, j: int) -> LinkProfile:
        """The link i -> j (peer indices): measured if it was, estimated otherwise."""
        bw, rtt = self.link_arrays(np.array([i]), np.array([j]))
        return LinkProfile(bandwidth=float(bw[0]), rtt=float(rtt[0]))

    def measured(self, i: int, j: int) -> bool:
        """Whether the link i -> j (peer indices) was measured, not estimated from the ends."""
        if not self._key.size:
            return False
        query = i * self.n + j
        at = min(int(np.searchsorted(self._key, query)), self._key.size - 1)
        return bool(self._key[at] == query)

    def link_arrays(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bandwidth and RTT of links i[k] -> j[k], measured where known, else estimated."""
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        if self._dense_bw is not None and self._dense_rtt is not None:
            return self._dense_bw[i, j], self._dense_rtt[i, j]
        bw = np.minimum(self.uplink[i], self.downlink[j])
        rtt = (self.peer_rtt[i] + self.peer_rtt[j]) / 2
        if self._key.size:
            query = i * self.n + j
            at = np.minimum(np.searchsorted(self._key, query), self._key.size - 1)
            hit = self._key[at] == query
            bw = np.where(hit, self.bandwidth[at], bw)
            rtt = np.where(hit, self.rtt[at], rtt)
        return bw, rtt

    def bandwidth_block(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(A, B) bandwidth of the links a[i] -> b[j], measured or estimated."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        if self._dense_bw is not None:
            return self._dense_bw[np.ix_(a, b)]
        ii = np.repeat(a, b.size)
        jj = np.tile(b, a.size)
        return self.link_arrays(ii, jj)[0].reshape(a.size, b.size)

    def dense(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, rtt) matrices among ``members`` (peer indices); the diagonal is inf / 0."""
        members = np.asarray(members, dtype=np.int64)
        if self._dense_bw is not None and self._dense_rtt is not None:
            block = np.ix_(members, members)
            bw, rtt = self._dense_bw[block], self._dense_rtt[block]
        else:
            ii, jj = np.meshgrid(members, members, indexing="ij")
            bw, rtt = self.link_arrays(ii.ravel(), jj.ravel())
            bw = bw.reshape(ii.shape)
            rtt = rtt.reshape(ii.shape)
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(rtt, 0.0)
        return bw, rtt


def _checked_links(
    n: int, src: np.ndarray, dst: np.ndarray, bandwidth: np.ndarray, rtt: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The link arrays as int64/float64; ConfigError unless they describe valid links."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    bandwidth = np.asarray(bandwidth, dtype=np.float64)
    rtt = np.asarray(rtt, dtype=np.float64)
    if not (src.shape == dst.shape == bandwidth.shape == rtt.shape) or src.ndim != 1:
        raise ConfigError(
            f"link arrays must be 1-D of one length, got {src.shape}, {dst.shape}, "
            f"{bandwidth.shape}, {rtt.shape}"
        )
    if src.size:
        if src.min() < 0 or dst.min() < 0 or max(src.max(), dst.max()) >= n:
            raise ConfigError(f"link endpoints must index the {n} peers")
        if np.any(src == dst):
            raise ConfigError("a link must join two different peers")
        if not (np.all(np.isfinite(bandwidth)) and np.all(bandwidth > 0)):
            raise ConfigError(f"link bandwidths must be > 0, min {bandwidth.min()}")
        if not (np.all(np.isfinite(rtt)) and np.all(rtt >= 0)):
            raise ConfigError(f"link rtts must be >= 0, min {rtt.min()}")
    return src, dst, bandwidth, rtt
