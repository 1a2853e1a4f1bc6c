"""OP-Fence step 1 and 2: group peers by link speed, order the groups into a chain.

Clustering is single linkage on the symmetric bandwidth min(bw(i->j), bw(j->i)): the fences at
threshold t are the components of the maximum spanning forest's edges of weight >= t (cutting
the forest's weak edges is exactly single linkage, and Kruskal gets it in O(E log E) from the
sparse measurements, which is what makes 10,000 peers plannable). Which threshold is best depends
on the model, so the planner tries the few thresholds at the largest gaps in log-bandwidth.
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np

from fusionllm.common.logs import get_logger
from fusionllm.dag.cost import LinkProfile
from fusionllm.dag.swarm import Swarm

logger = get_logger(__name__)

DENSE_LIMIT = 512  # up to this many peers, unmeasured pairs (estimated) take part in clustering
_EXHAUSTIVE_CHAIN = 6  # up to this many fences, try every chain order
# Up to this many replicas an all-reduce is bounded by its best spanning tree's weakest link;
# above, by the slowest member's access link (see group_allreduce_link).
ALLREDUCE_TREE_LIMIT = 64


@dataclass(frozen=True)
class Forest:
    """Maximum spanning forest of the symmetric bandwidth graph: edges strongest first."""

    n: int
    u: np.ndarray
    v: np.ndarray
    weight: np.ndarray  # symmetric bandwidth, bytes/s, non-increasing
    rtt: np.ndarray  # the larger RTT of the two directions


def _find(parent: list[int], x: int) -> int:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _symmetric_edges(swarm: Swarm) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = swarm.n
    if n <= DENSE_LIMIT:
        u, v = np.triu_indices(n, k=1)
    else:
        u = np.minimum(swarm.src, swarm.dst)
        v = np.maximum(swarm.src, swarm.dst)
        _, first = np.unique(u * n + v, return_index=True)
        return u[first], v[first], swarm.symmetric_bandwidth[first], swarm.symmetric_rtt[first]
    forward_bw, forward_rtt = swarm.link_arrays(u, v)
    back_bw, back_rtt = swarm.link_arrays(v, u)
    return u, v, np.minimum(forward_bw, back_bw), np.maximum(forward_rtt, back_rtt)


def max_spanning_forest(swarm: Swarm) -> Forest:
    """Kruskal on the symmetric weights, strongest edge first, ties by (u, v)."""
    u, v, weight, rtt = _symmetric_edges(swarm)
    order = np.lexsort((v, u, -weight))
    parent = list(range(swarm.n))
    keep: list[int] = []
    needed = swarm.n - 1
    for e, a, b in zip(order.tolist(), u[order].tolist(), v[order].tolist(), strict=True):
        ra, rb = _find(parent, a), _find(parent, b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
            keep.append(e)
            if len(keep) == needed:
                break
    idx = np.asarray(keep, dtype=np.int64)
    return Forest(n=swarm.n, u=u[idx], v=v[idx], weight=weight[idx], rtt=rtt[idx])


def fences_at(forest: Forest, threshold: float) -> list[np.ndarray]:
    """Components joined by forest edges of weight >= threshold, each as sorted peer indices,
    listed by their smallest member."""
    parent = list(range(forest.n))
    strong = forest.weight >= threshold
    for a, b in zip(forest.u[strong].tolist(), forest.v[strong].tolist(), strict=True):
        ra, rb = _find(parent, a), _find(parent, b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = np.array([_find(parent, x) for x in range(forest.n)], dtype=np.int64)
    order = np.argsort(roots, kind="stable")
    boundaries = np.flatnonzero(np.diff(roots[order])) + 1
    return [np.sort(group) for group in np.split(order, boundaries)]


def candidate_thresholds(forest: Forest, levels: int) -> list[float]:
    """Thresholds worth trying, strongest clustering (fewest fences) first.

    0 (only the forest's components) plus one threshold in each of the ``levels`` widest gaps
    between consecutive distinct forest weights on a log scale: a gap is where "fast" ends.
    """
    distinct = np.unique(forest.weight)[::-1]  # decreasing
    thresholds = [0.0]
    if distinct.size >= 1:
        if distinct.size > 1:
            log_w = np.log(distinct)
            gaps = log_w[:-1] - log_w[1:]
            widest = np.argsort(-gaps, kind="stable")[: max(0, levels - 1)]
            # The threshold sits in the gap, so ties in measured values never straddle it.
            thresholds += [float(np.sqrt(distinct[g] * distinct[g + 1])) for g in widest]
        thresholds.append(float(distinct[0]) * 1.000001)  # every peer its own fence
    return sorted(set(thresholds))


def group_allreduce_link(swarm: Swarm, members: np.ndarray) -> LinkProfile:
    """The slowest link an all-reduce among ``members`` must use: the weakest edge of their
    maximum spanning tree (a ring or tree can be routed along it), with that tree's worst RTT.

    Above ALLREDUCE_TREE_LIMIT members the group is bounded by its slowest access link: in a
    ring or butterfly all-reduce over that many peers every member sends and receives about
    twice the gradient through its own uplink and downlink, so the slowest one sets the pace
    (and the spanning tree, a Python loop per member, dominated planning time at 1,000 peers).
    """
    members = np.asarray(members, dtype=np.int64)
    r = members.size
    if r <= 1:
        return LinkProfile(bandwidth=math.inf, rtt=0.0)
    if r <= ALLREDUCE_TREE_LIMIT:
        bw, rtt = swarm.dense(members)
        sym = np.minimum(bw, bw.T)
        sym_rtt = np.maximum(rtt, rtt.T)
        # Prim, maximum version; the bottleneck is the weakest edge it adds.
        in_tree = np.zeros(r, dtype=bool)
        in_tree[0] = True
        best = sym[0].copy()
        best_rtt = sym_rtt[0].copy()
        weakest, worst_rtt = math.inf, 0.0
        for _ in range(r - 1):
            cand = np.where(in_tree, -1.0, best)
            j = int(np.argmax(cand))
            weakest = min(weakest, float(best[j]))
            worst_rtt = max(worst_rtt, float(best_rtt[j]))
            in_tree[j] = True
            better = sym[j] > best
            best = np.where(better, sym[j], best)
            best_rtt = np.where(better, sym_rtt[j], best_rtt)
        return LinkProfile(bandwidth=weakest, rtt=worst_rtt)
    access = float(min(swarm.uplink[members].min(), swarm.downlink[members].min()))
    return LinkProfile(bandwidth=access, rtt=float(np.median(swarm.peer_rtt[members])))


def group_links(swarm: Swarm, groups: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(K, K) bandwidth and RTT from group a to group b over the best measured pair.

    Activations between two fences travel over one peer pair, so the best pair is the one to
    use; pairs of groups with no measured link between them fall back to the best estimate,
    min(best uplink in a, best downlink in b). The diagonal is inf / 0.
    """
    k = len(groups)
    label = np.full(swarm.n, -1, dtype=np.int64)
    for g, members in enumerate(groups):
        label[members] = g
    a, b = label[swarm.src], label[swarm.dst]
    mask = (a >= 0) & (b >= 0) & (a != b)
    measured = np.full((k, k), -1.0)
    np.maximum.at(measured, (a[mask], b[mask]), swarm.bandwidth[mask])
    # RTT of the best measured pair: among edges achieving the max, the smallest RTT.
    rtt = np.full((k, k), np.inf)
    if mask.any():
        am, bm = a[mask], b[mask]
        best = swarm.bandwidth[mask] >= measured[am, bm]
        np.minimum.at(rtt, (am[best], bm[best]), swarm.rtt[mask][best])
    best_up = np.array([swarm.uplink[m].max() for m in groups])
    best_down = np.array([swarm.downlink[m].max() for m in groups])
    min_rtt = np.array([swarm.peer_rtt[m].min() for m in groups])
    estimate = np.minimum.outer(best_up, best_down)
    estimate_rtt = np.add.outer(min_rtt, min_rtt) / 2
    have = measured > 0
    bw = np.where(have, measured, estimate)
    rtt = np.where(have, rtt, estimate_rtt)
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(rtt, 0.0)
    return bw, rtt


def _chain_key(sym: np.ndarray, chain: tuple[int, ...]) -> tuple[float, float]:
    if len(chain) < 2:
        return (math.inf, 0.0)
    links = [sym[a, b] for a, b in itertools.pairwise(chain)]
    return (min(links), sum(math.log(x) for x in links))


def order_chain(bandwidth: np.ndarray) -> tuple[int, ...]:
    """Order K groups into a chain maximising its slowest link (then the sum of log links).

    Exhaustive up to _EXHAUSTIVE_CHAIN groups; above, greedy best-next-link from every start,
    which is exact for the bottleneck whenever the fast links form a path (the usual sites case).
    """
    k = bandwidth.shape[0]
    if k <= 1:
        return tuple(range(k))
    sym = np.minimum(bandwidth, bandwidth.T)
    best: tuple[int, ...] | None = None
    best_key = (-math.inf, -math.inf)
    if k <= _EXHAUSTIVE_CHAIN:
        candidates = (p for p in itertools.permutations(range(k)) if p[0] < p[-1])
    else:
        candidates = (_greedy_chain(sym, start) for start in range(k))
    for chain in candidates:
        key = _chain_key(sym, chain)
        if key > best_key:
            best, best_key = chain, key
    assert best is not None
    return best


def _greedy_chain(sym: np.ndarray, start: int) -> tuple[int, ...]:
    k = sym.shape[0]
    used = np.zeros(k, dtype=bool)
    used[start] = True
    chain = [start]
    for _ in range(k - 1):
        row = np.where(used, -1.0, sym[chain[-1]])
        nxt = int(np.argmax(row))
        used[nxt] = True
        chain.append(nxt)
    return tuple(chain)
