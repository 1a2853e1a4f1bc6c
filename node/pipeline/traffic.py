"""What a runner's links carried in one step: bytes before and after compression, the codec.

The runner adds one entry per frame it packs (activations forward, gradients backward) and
hands the step's tally out in its StepReport; the trainer's step event carries it, and the
node's metrics (observe/metrics.py) add it up. Counting is a dict update per frame.
"""

import threading
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LinkTally:
    """One link direction over one step: ``link`` k joins stage k and stage k + 1."""

    link: int
    kind: str  # "activation" (forward) or "gradient" (backward)
    codec: str  # the codec_id of the step's last frame (compression/codecs.py)
    frames: int
    dense_bytes: int  # the tensors' bytes before compression
    wire_bytes: int  # the frames' bytes as sent

    def to_json(self) -> dict:
        return {
            "link": self.link,
            "kind": self.kind,
            "codec": self.codec,
            "frames": self.frames,
            "dense_bytes": self.dense_bytes,
            "wire_bytes": self.wire_bytes,
        }


class LinkTraffic:
    """A step's tally; ``add`` from the runner's thread (or an evaluation's), ``take`` at the
    step's end starts the next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (link, kind) -> [codec, frames, dense bytes, wire bytes]
        self._tally: dict[tuple[int, str], list] = {}

    def add(self, *, link: int, kind: str, codec: str, dense_bytes: int, wire_bytes: int) -> None:
        with self._lock:
            entry = self._tally.setdefault((link, kind), [codec, 0, 0, 0])
            entry[0] = codec
            entry[1] += 1
            entry[2] += dense_bytes
            entry[3] += wire_bytes

    def take(self) -> tuple[LinkTally, ...]:
        with self._lock:
            tally, self._tally = self._tally, {}
        return tuple(
            LinkTally(link=link, kind=kind, codec=c, frames=f, dense_bytes=d, wire_bytes=w)
            for (link, kind), (c, f, d, w) in sorted(tally.items())
        )
