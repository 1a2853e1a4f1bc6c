"""How long a frame takes on a TCP connection that sat idle: Linux's congestion window restart.

After a connection sends nothing for longer than its retransmission timeout, Linux halves its
congestion window once per timeout of silence, down to the initial window (RFC 5681 4.1,
``tcp_cwnd_restart``), and slow start doubles it again once per round trip. A frame of a slow
pipeline meets that on every link whose frames come further apart than the timeout: on the
testbed's topology C (issue 25) a 128 KiB activation over a 1 MB/s, 80 ms link takes ~0.27 s
from the initial window, not 0.13 s, and a naive plan stepped in 1.80 s against an estimate
of 1.06 s; with the restart turned off in every namespace (tcp_slow_start_after_idle=0) a naive
plan (another peer order) stepped in 1.41 s, 0.95 of its estimate. A node cannot turn it off
for its user (a sysctl, root, per network namespace), so the estimate counts it.

Pure functions of bytes, bytes/s and seconds; the simulator (simulate.py) tracks each
connection's silence.
"""

import math

INITIAL_WINDOW_BYTES = 10 * 1448  # Linux's initial window (RFC 6928) at a 1500-byte MTU
RTO_MIN_S = 0.2  # Linux's minimum retransmission timeout (TCP_RTO_MIN)


def rto(rtt: float) -> float:
    """The retransmission timeout of a connection with a steady round trip ``rtt``: Linux's
    srtt plus its variance term, which is at least RTO_MIN_S."""
    return rtt + RTO_MIN_S


def window_after_idle(idle_s: float, rtt: float, bandwidth: float) -> float:
    """The congestion window (bytes) a send starts with after ``idle_s`` of silence on a
    connection whose window had grown to the path's bandwidth-delay product."""
    warm = max(bandwidth * rtt, INITIAL_WINDOW_BYTES)
    timeout = rto(rtt)
    if not idle_s > timeout:
        return warm
    halvings = min(64, math.ceil(idle_s / timeout) - 1)
    return max(warm / 2**halvings, INITIAL_WINDOW_BYTES)


def send_time(nbytes: float, bandwidth: float, rtt: float, window: float) -> float:
    """Seconds from a frame's first byte leaving to its last, starting from ``window``: a
    window that does not fill the path sends its bytes, then waits a round trip for their
    acknowledgements and doubles (slow start); once it fills the path, or holds the rest of
    the frame, the rest leaves at the link's rate."""
    if not (bandwidth > 0 and rtt >= 0 and window > 0 and nbytes >= 0):
        raise ValueError(f"bad link or frame: {nbytes} B, {bandwidth} B/s, {rtt} s, {window} B")
    elapsed, left, path = 0.0, float(nbytes), bandwidth * rtt
    for _ in range(64):  # the window at least doubles each round
        if window >= path or window >= left:
            break
        elapsed, left, window = elapsed + rtt, left - window, 2 * window
    return elapsed + left / bandwidth
