"""A 1 Gbit/s link measured by the kernel on the lane that carries frames, with the sender's
CPU share taken by a busy process (issue 25: on topology A under training load the Python-paced
probe read such links at 2.65-35 MB/s of 125, and AdaTopK compressed a LAN link).

Host a has topology A's 0.45-core share and busy loops in it; its lane writer seals and writes
1 MiB frames to b, 50 ms apart, for a few seconds. The figures its WireMeter kept (the ones
LinkMonitor files) must price the link within 2x of its cap, above every WAN link of
topologies B and C (<= 100 Mbit/s, 12.5 MB/s) by far, and never above the cap by more than
the issue's 20%. Frames of 128 KiB 20 ms apart give no kernel figure (docs/testbed.md),
so the links probe themselves on the lane instead: a bulk probe (lane/bulk.py, 1 MiB of
filler back to back, what LinkMonitor sends a plan neighbour) under the same busy loops must
read the link as the frames do.
"""

import statistics
import subprocess
import sys

import pytest

from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.topology import parse_topology
from tests.support.lane_main import bulk_figures, lane_figures

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(120)]

BUSY = 4
GAP_S = 0.05  # a stage computes between its frames
BULK_ROUNDS = 4
CAP_MB_S = 125.0  # 1 Gbit/s
OVER = 1.2  # issue 25: a measured link within 20% of its cap
TOPOLOGY = {
    "name": "lan",
    "hosts": [{"name": "a", "cpu": 0.45}, {"name": "b"}],
    "links": [{"hosts": ["a", "b"], "delay_ms": 0.25, "rate_mbps": CAP_MB_S * 8}],
}


def test_a_busy_hosts_lane_reads_a_lan_link_near_its_cap(tmp_path):
    with Testbed(parse_topology(TOPOLOGY)) as bed:
        loop = [sys.executable, "-c", "while True: pass"]
        busy = [bed.popen("a", loop, stdout=subprocess.DEVNULL) for _ in range(BUSY)]
        try:
            lane = lane_figures(bed, "a", "b", seconds=6.0, gap_s=GAP_S)
            bulks = bulk_figures(bed, "a", "b", rounds=BULK_ROUNDS, nbytes=1 << 20, gap_s=0.2)
        finally:
            for process in busy:
                process.kill()
                process.wait(timeout=10)
    figures = [s["bandwidth"] / 1e6 for s in lane["samples"]]
    paced = lane["bytes"] / lane["seconds"] / 1e6
    low, best = min(figures, default=0), max(figures, default=0)
    rtt_ms = min((s["rtt"] for s in lane["samples"]), default=0) * 1e3
    print(f"{len(figures)} lane figures, {low:.1f}-{best:.1f} MB/s of {CAP_MB_S} (median "
          f"{statistics.median(figures or [0]):.1f}); the busy sender put through "
          f"{paced:.1f} MB/s; rtt {rtt_ms:.2f} ms")  # fmt: skip
    assert len(figures) >= 2, "the meter kept under 2 samples in 6 s of frames"
    # The book prices a link by the best of its window (bandwidth.py). Over it by the issue's
    # 20% at most: the emulator hands over GSO segments whole (up to 64 KiB at once, a fifth
    # of this link's 0.5 ms round trip), so ACKs come bunched; an interval's median read 1.10x
    # in CI (session 14), single samples 1.14x (wire_meter.py).
    assert CAP_MB_S / 2 <= max(figures) <= CAP_MB_S * OVER
    assert all(f <= CAP_MB_S * OVER for f in figures)
    bulk = [f["bandwidth"] / 1e6 for f in bulks if f is not None]
    print(f"bulk probes: {[round(f, 1) for f in bulk]} MB/s of {CAP_MB_S}, "
          f"{BULK_ROUNDS - len(bulk)} without a trusted sample")  # fmt: skip
    assert len(bulk) >= BULK_ROUNDS // 2, f"{len(bulk)} of {BULK_ROUNDS} bulk probes gave a figure"
    assert CAP_MB_S / 2 <= max(bulk) <= CAP_MB_S * OVER
    assert all(f <= CAP_MB_S * OVER for f in bulk)
