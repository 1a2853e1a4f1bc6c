"""What a node measured of its own work last time, kept beside its key for its next start.

A fresh swarm's first plan is made before any member has trained a step, so every member is
planned at its device's model alone (stretch.py). On topology B that model put the first
plan at 0.054-0.058 s for steps of 0.085-0.090 (session 18), and the first measured stretch
reached the plan 78-85 steps later: half of a 160-step run trained on an estimate 35% low.
A node that has trained the same work on the same device before knows better: it keeps the
last confirmed slowdown (pace x stretch: both are planned as their product) in
``<key>.stretch.json``, per work (model, sequence length, micro-batch size and count,
precision) and device, and starts from it as a provisional stretch: its first measured
window replaces it whatever the band (``StretchMeter.recall``).

The file is ours, but read as untrusted: a bad file (size, JSON, types, values out of range)
is logged and ignored, never fatal, and rewritten on the next figure kept.
"""

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

from fusionllm.common.atomic import write_atomic
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import RunSpec
from fusionllm.dht.records import MAX_STRETCH, DeviceInfo

logger = get_logger(__name__)

MAX_FILE_BYTES = 64 << 10
MAX_ENTRIES = 32  # works x devices; the oldest go first
_VERSION = 1


class StretchMemoryError(ValueError):
    """The memory file is not what this module writes."""


def memory_path(key_path: Path) -> Path:
    """Beside the node's key: what belongs to this node, wherever its identity lives."""
    return key_path.with_name(key_path.name + ".stretch.json")


def work_key(run: RunSpec, device: DeviceInfo) -> str:
    """Which work on which device a figure was measured for: the same key, the same figure."""
    work = {
        "model": run.model_key, "seq_len": run.seq_len, "precision": run.precision,
        "micro_batch_size": run.micro_batch_size, "micro_batches": run.micro_batches,
        "device": device.to_wire(),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(work, sort_keys=True).encode()).hexdigest()[:32]


def parse_memory(raw: bytes) -> dict[str, tuple[float, float]]:
    """key -> (slowdown, when kept) from the file's bytes; StretchMemoryError if malformed."""
    if len(raw) > MAX_FILE_BYTES:
        raise StretchMemoryError(f"{len(raw)} bytes, over {MAX_FILE_BYTES}")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StretchMemoryError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != _VERSION:
        raise StretchMemoryError("not a version-1 map")
    entries = data.get("entries")
    if not isinstance(entries, dict) or len(entries) > MAX_ENTRIES:
        raise StretchMemoryError(f"entries must be a map of at most {MAX_ENTRIES}")
    out = {}
    for key, entry in entries.items():
        if not (isinstance(key, str) and len(key) == 32 and isinstance(entry, list)
                and len(entry) == 2):  # fmt: skip
            raise StretchMemoryError(f"entry {str(key)[:40]!r} is malformed")
        slowdown, kept = entry
        if not all(type(v) in (int, float) and math.isfinite(v) for v in entry):
            raise StretchMemoryError(f"entry {key!r}: values must be finite numbers")
        if not 1.0 <= slowdown <= MAX_STRETCH or kept < 0:
            raise StretchMemoryError(
                f"entry {key!r}: slowdown {slowdown} out of [1, {MAX_STRETCH}]"
            )
        out[key] = (float(slowdown), float(kept))
    return out


@dataclasses.dataclass
class StretchMemory:
    """One node's file; ``key`` names the work and device this run measures."""

    path: Path
    key: str
    _kept: float = (
        0.0  # the figure last written this run: a step that changes nothing writes nothing
    )

    def recall(self) -> float:
        """The slowdown last kept for our key; 0.0 if none (or the file is unreadable)."""
        entry = self._read().get(self.key)
        return entry[0] if entry else 0.0

    def keep(self, slowdown: float) -> None:
        """Remember ``slowdown`` for our key (a no-op if it is what we kept last)."""
        if not (math.isfinite(slowdown) and 1.0 <= slowdown <= MAX_STRETCH):
            return
        if slowdown == self._kept:
            return
        entries = self._read()
        entries[self.key] = (slowdown, time.time())
        newest = sorted(entries.items(), key=lambda kv: kv[1][1])[-MAX_ENTRIES:]
        body = {"v": _VERSION, "entries": {k: list(v) for k, v in newest}}
        try:
            write_atomic(self.path, json.dumps(body).encode())
        except OSError as exc:
            logger.warning("could not keep our stretch in %s: %s", self.path, exc)
            return
        self._kept = slowdown

    def _read(self) -> dict[str, tuple[float, float]]:
        try:
            with self.path.open("rb") as file:
                raw = file.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            logger.warning("could not read %s: %s", self.path, exc)
            return {}
        try:
            return parse_memory(raw)
        except StretchMemoryError as exc:
            logger.warning("ignoring %s: %s", self.path, exc)
            return {}
