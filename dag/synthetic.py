"""Synthetic inputs for planning: a GPT-2-like GraphCosts, a GPU catalog, generated swarms.

The graph mirrors what tracing nanoGPT-style GPT-2 gives (per block: ln_1, c_attn, attention,
attn_proj, add, ln_2, c_fc, gelu, mlp_proj, add), with FLOPs and bytes from the shapes, so the
planner and benchmarks run before (and independently of) the tracer; a traced OpGraph's
``costs()`` drops in where ``gpt2_costs`` is used. lm_head is counted untied from wte (a stage
split cannot share them). Swarm generators take a numpy Generator: same seed, same swarm.
"""

from dataclasses import dataclass

import numpy as np

from fusionllm.dag.cost import DeviceProfile, mbps
from fusionllm.dag.graph import GraphCosts, OpNode
from fusionllm.dag.swarm import Peer, Swarm

GB = 10**9


@dataclass(frozen=True)
class Gpt2Shape:
    n_layer: int
    d_model: int
    n_head: int
    vocab: int = 50257
    n_ctx: int = 1024


GPT2_SIZES = {
    "small": Gpt2Shape(12, 768, 12),
    "medium": Gpt2Shape(24, 1024, 16),
    "large": Gpt2Shape(36, 1280, 20),
    "xl": Gpt2Shape(48, 1600, 25),
}


def gpt2_costs(size: str = "small", *, batch: int = 1, seq: int = 1024) -> GraphCosts:
    """GraphCosts of GPT-2 ``size`` for ``batch`` sequences of ``seq`` tokens (fp32)."""
    shape = GPT2_SIZES[size]
    d, v, h = shape.d_model, shape.vocab, shape.n_head
    tokens = batch * seq
    act = 4 * tokens * d  # one fp32 (B, T, C) tensor
    nodes: list[OpNode] = []

    def add(node_id: str, op: str, inputs: tuple[str, ...], fwd: float, params: int, out: int,
            saved: int) -> None:  # fmt: skip
        nodes.append(
            OpNode(
                node_id=node_id,
                op=op,
                inputs=inputs,
                forward_flops=int(fwd),
                backward_flops=int(2 * fwd),  # grads w.r.t. inputs and weights
                param_bytes=int(params),
                output_bytes=int(out),
                peak_activation_bytes=int(saved),
            )
        )

    # saved = what autograd keeps for backward (flops.py's rules): a linear or norm keeps its
    # input, gelu its input, a fused attention q, k, v, output and log-sum-exp, an add nothing.
    add("wte", "embedding", ("idx",), tokens * d, 4 * (v * d + shape.n_ctx * d), act, 8 * tokens)
    x = "wte"
    for i in range(shape.n_layer):
        p = f"h{i}"
        add(f"{p}_ln_1", "layer_norm", (x,), 8 * tokens * d, 4 * 2 * d, act, act)
        qkv_params = 4 * (3 * d * d + 3 * d)
        add(f"{p}_c_attn", "linear", (f"{p}_ln_1",), 6 * tokens * d * d, qkv_params, 3 * act, act)
        add(f"{p}_attn", "sdpa", (f"{p}_c_attn",), 4 * batch * seq * seq * d, 0, act,
            4 * act + 4 * batch * h * seq)  # fmt: skip
        add(f"{p}_attn_proj", "linear", (f"{p}_attn",), 2 * tokens * d * d, 4 * (d * d + d), act,
            act)  # fmt: skip
        add(f"{p}_add_1", "add", (x, f"{p}_attn_proj"), tokens * d, 0, act, 0)
        add(f"{p}_ln_2", "layer_norm", (f"{p}_add_1",), 8 * tokens * d, 4 * 2 * d, act, act)
        add(f"{p}_c_fc", "linear", (f"{p}_ln_2",), 2 * tokens * d * 4 * d, 4 * (4 * d * d + 4 * d),
            4 * act, act)  # fmt: skip
        add(f"{p}_gelu", "gelu", (f"{p}_c_fc",), 8 * tokens * 4 * d, 0, 4 * act, 4 * act)
        add(f"{p}_mlp_proj", "linear", (f"{p}_gelu",), 2 * tokens * 4 * d * d,
            4 * (4 * d * d + d), act, 4 * act)  # fmt: skip
        add(f"{p}_add_2", "add", (f"{p}_add_1", f"{p}_mlp_proj"), tokens * d, 0, act, 0)
        x = f"{p}_add_2"
    add("ln_f", "layer_norm", (x,), 8 * tokens * d, 4 * 2 * d, act, act)
    add("lm_head", "linear", ("ln_f",), 2 * tokens * d * v, 4 * v * d, 4 * tokens * v, act)
    add("loss", "cross_entropy", ("lm_head", "idx"), 5 * tokens * v, 0, 4, 4 * tokens * v)
    return GraphCosts(nodes=tuple(nodes), input_bytes={"idx": 8 * tokens}, output_names=("loss",))


# Achievable mixed-precision training throughput (~40% of tensor-core peak), not datasheet peak.
GPUS: dict[str, DeviceProfile] = {
    "rtx3060": DeviceProfile(
        name="rtx3060", flops=12e12, memory_bandwidth=360e9, memory_bytes=12 * GB
    ),
    "rtx2080ti": DeviceProfile(
        name="rtx2080ti", flops=20e12, memory_bandwidth=616e9, memory_bytes=11 * GB
    ),
    "rtx3080": DeviceProfile(
        name="rtx3080", flops=25e12, memory_bandwidth=760e9, memory_bytes=10 * GB
    ),
    "rtx3090": DeviceProfile(
        name="rtx3090", flops=30e12, memory_bandwidth=936e9, memory_bytes=24 * GB
    ),
    "rtx4090": DeviceProfile(
        name="rtx4090", flops=65e12, memory_bandwidth=1008e9, memory_bytes=24 * GB
    ),
    "v100": DeviceProfile(name="v100", flops=50e12, memory_bandwidth=900e9, memory_bytes=32 * GB),
    "a100": DeviceProfile(name="a100", flops=125e12, memory_bandwidth=2039e9, memory_bytes=80 * GB),
    "h100": DeviceProfile(name="h100", flops=400e12, memory_bandwidth=3350e9, memory_bytes=80 * GB),
}
CONSUMER = ("rtx3060", "rtx2080ti", "rtx3080", "rtx3090", "rtx4090")
DATACENTER = ("v100", "a100", "h100")

TOPOLOGIES = ("flat", "sites", "home")


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, size: int | tuple) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size))


def _devices(rng: np.random.Generator, n: int, datacenter_share: float) -> list[DeviceProfile]:
    dc = rng.random(n) < datacenter_share
    names = [
        DATACENTER[rng.integers(len(DATACENTER))] if d else CONSUMER[rng.integers(len(CONSUMER))]
        for d in dc
    ]
    return [GPUS[x] for x in names]


@dataclass(frozen=True)
class _Sites:
    """The "sites" topology: each peer's site (sorted) and its device; per site a LAN and a
    WAN bandwidth; RTTs between sites."""

    site: np.ndarray  # (n,) site index of each peer
    devices: list[DeviceProfile]
    lan: np.ndarray  # (k,) bytes/s
    wan: np.ndarray  # (k,) bytes/s
    base_rtt: np.ndarray  # (k, k) s, symmetric

    @classmethod
    def draw(
        cls, rng: np.random.Generator, n: int, sites: int | None, datacenter_share: float
    ) -> "_Sites":
        k = sites if sites is not None else int(rng.integers(2, 7))
        site = np.sort(rng.integers(0, k, n))
        site_is_dc = rng.random(k) < datacenter_share
        lan = _log_uniform(rng, mbps(1000), mbps(10000), k)
        wan = _log_uniform(rng, mbps(8), mbps(1000), k)
        devices = [
            GPUS[DATACENTER[rng.integers(3)]] if site_is_dc[s] else GPUS[CONSUMER[rng.integers(5)]]
            for s in site
        ]
        base_rtt = _log_uniform(rng, 0.01, 0.15, (k, k))
        base_rtt = (base_rtt + base_rtt.T) / 2
        np.fill_diagonal(base_rtt, 0.0005)
        return cls(site=site, devices=devices, lan=lan, wan=wan, base_rtt=base_rtt)

    def links(
        self, rng: np.random.Generator, src: np.ndarray, dst: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, rtt) of the links src -> dst: LAN inside a site, WAN between sites."""
        site = self.site
        same = site[src] == site[dst]
        lan_bw = np.minimum(self.lan[site[src]], self.lan[site[dst]])
        wan_bw = np.minimum(self.wan[site[src]], self.wan[site[dst]])
        bw = np.where(same, lan_bw, wan_bw) * rng.uniform(0.8, 1.0, src.size)
        rtt = self.base_rtt[site[src], site[dst]] * rng.uniform(1.0, 1.2, src.size)
        return bw, rtt


def _probed_pairs(
    rng: np.random.Generator, n: int, sample: int | None, site: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) of the measured links, both directions of every probed pair: all pairs, or
    ``sample`` probes per peer (half inside its own site when ``site`` is given)."""
    if sample is None and n <= 64:
        src, dst = np.nonzero(~np.eye(n, dtype=bool))
        return src, dst
    m = sample if sample is not None else 32
    local = rng.integers(0, n, (n, m))
    if site is not None:
        # Half the probes go to random peers of the own site.
        starts = np.searchsorted(site, site)
        counts = np.bincount(site, minlength=site.max() + 1)[site]
        offs = (rng.random((n, m // 2)) * counts[:, None]).astype(np.int64)
        local[:, : m // 2] = starts[:, None] + offs
    src = np.repeat(np.arange(n), m)
    dst = local.ravel()
    keep = src != dst
    src, dst = src[keep], dst[keep]
    key = np.unique(np.concatenate([src * n + dst, dst * n + src]))  # both directions
    return key // n, key % n


def generate_swarm(
    topology: str,
    n: int,
    rng: np.random.Generator,
    *,
    sites: int | None = None,
    sample: int | None = None,
    datacenter_share: float = 0.3,
) -> Swarm:
    """A swarm of ``n`` peers; links from 8 Mbps to 10 Gbps.

    flat:  every peer has its own access link (8 Mbps-10 Gbps); a pair gets the slower end.
    sites: ``sites`` sites (default 2-6); LANs of 1-10 Gbps inside, WAN links of 8 Mbps-1 Gbps
           between sites; one site is all datacenter or all consumer GPUs (like the testbeds).
    home:  consumer GPUs behind home lines: 8-100 Mbps up, 50-1000 Mbps down.
    sample: peers measured per peer (default: all when n <= 64, else 32, half of them inside
    the own site, as a locality-aware prober would); the rest are estimated by the planner.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    layout = None
    if topology == "sites":
        layout = _Sites.draw(rng, n, sites, datacenter_share)
        devices = layout.devices
        # A peer's access link is its LAN port; the WAN limit shows in measured cross-site
        # links (the estimate min(up, down) is only used where nothing was measured).
        up = down = layout.lan[layout.site]
    elif topology == "flat":
        devices = _devices(rng, n, datacenter_share)
        up = _log_uniform(rng, mbps(8), mbps(10000), n)
        down = np.minimum(up * rng.uniform(1, 4, n), mbps(10000))
    else:
        devices = [GPUS[CONSUMER[rng.integers(len(CONSUMER))]] for _ in range(n)]
        up = _log_uniform(rng, mbps(8), mbps(100), n)
        down = _log_uniform(rng, mbps(50), mbps(1000), n)
    peer_rtt = _log_uniform(rng, 0.005, 0.1, n)
    src, dst = _probed_pairs(rng, n, sample, layout.site if layout is not None else None)
    if layout is not None:
        bw, rtt = layout.links(rng, src, dst)
    else:
        bw = np.minimum(up[src], down[dst]) * rng.uniform(0.5, 1.0, src.size)
        rtt = (peer_rtt[src] + peer_rtt[dst]) / 2 * rng.uniform(1.0, 1.5, src.size)
    width = len(str(n - 1))
    peers = [
        Peer(
            peer_id=f"p{i:0{width}d}",
            device=devices[i],
            uplink=float(up[i]),
            downlink=float(down[i]),
            rtt=float(peer_rtt[i]),
        )
        for i in range(n)
    ]
    return Swarm.from_arrays(peers, src, dst, bw, rtt)
