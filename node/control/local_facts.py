"""What a node learns once at start with torch's help, learned in a short-lived child process.

Planning needs the run's model costs (a torch.fx trace) and this machine's device (a timed
probe, cached on disk). Doing either in the node's process would load torch (~200 MiB RSS,
measured) into every node, including those that never serve a stage; the child pays for it
and exits, and the node keeps a few KiB of plain data. The costs are cached on disk beside the
device measurement, per model, sequence length and versions: a node whose device is known
(cached by the child, or given) starts with no child at all.
"""

import json
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import STDLIB_VOCAB, RunSpec
from fusionllm.dag.graph import GraphCosts, costs_from_json, costs_to_json
from fusionllm.dht.records import DeviceInfo
from fusionllm.node.children import JsonChild
from fusionllm.node.control.stretch import Rehearsal

logger = get_logger(__name__)

_FIRST_PROBE_S = 600.0  # a cold start imports torch and times the device: seconds, not minutes
_COSTS_FORMAT = 1


class FactsError(FusionError):
    """The child that traces the model and probes the device failed or said something else."""


@dataclass(frozen=True, kw_only=True)
class LocalFacts:
    device: DeviceInfo | None  # None when the caller knew it already
    costs: GraphCosts
    rehearsal: Rehearsal | None = None  # asked for and timed (rehearsal.py), else None


@dataclass(frozen=True, kw_only=True)
class RehearsalAsk:
    """A rehearsal to time in the child: ``seconds`` of steps at the run's micro-batch shape."""

    seconds: float
    batch: int
    micro_batches: int
    threads: int = 0  # torch's threads, as the node computes with (0: torch's choice)

    @classmethod
    def for_node(
        cls, observer: bool, seconds: float, threads: int, run: RunSpec
    ) -> "RehearsalAsk | None":
        """A node's rehearsal of its run's first stage: none where it trains nothing or
        ``seconds`` is 0."""
        if observer or not seconds:
            return None
        return cls(seconds=seconds, batch=run.micro_batch_size, micro_batches=run.micro_batches,
                   threads=threads)  # fmt: skip


def learn_local_facts(
    model: str,
    seq_len: int,
    *,
    device_cache: Path | None,
    measure_device: bool,
    timeout_s: float = _FIRST_PROBE_S,
    model_dir: str | None = None,
    device: str = "auto",
    precision: str = "fp32",
    vocab_size: int = STDLIB_VOCAB,
    rehearse: RehearsalAsk | None = None,
) -> LocalFacts:
    """The model's costs (cached) and, if ``measure_device``, this machine's ``device`` (the
    one our stages train on) at the run's ``precision``; with ``rehearse``, a rehearsal of
    the run's first stage timed on that device (rehearsal.py: every start, as it times the
    host as it is now).

    ``model`` names the cache (``RunSpec.model_key``: a folder's digest, not its path);
    ``model_dir`` is the Hugging Face folder whose config.json the child costs; a preset is
    costed at ``vocab_size`` (the run's data's: the embedding and the head scale with it).
    """
    cache_dir = device_cache.parent if device_cache else Path.home() / ".cache" / "fusionllm"
    costs_path = cache_dir / costs_file_name(model, seq_len, vocab_size)
    cached = _read_costs(costs_path)
    if cached is not None and not measure_device and rehearse is None:
        return LocalFacts(device=None, costs=cached)
    # The device is the one measured, rehearsed on, or both (--no-device: not measured).
    probe = ["--device", device, "--precision", precision]
    if not measure_device:
        probe.append("--no-device")
    if rehearse is not None:
        probe += ["--rehearse-s", str(rehearse.seconds), "--micro-batch-size",
                  str(rehearse.batch), "--micro-batches", str(rehearse.micro_batches),
                  "--threads", str(rehearse.threads)]  # fmt: skip
    sizes = ["--seq-len", str(seq_len), "--vocab-size", str(vocab_size)]
    facts = _ask_child(model, sizes, device_cache, probe, timeout_s, model_dir, measure_device)
    if cached is None:
        try:
            write_atomic(costs_path, json.dumps(costs_to_json(facts.costs)).encode())
        except OSError as exc:
            logger.warning("could not cache the model's costs in %s: %s", costs_path, exc)
    return facts


def costs_file_name(model: str, seq_len: int, vocab_size: int = STDLIB_VOCAB) -> str:
    """One file per model, sequence length, vocabulary and the versions that could change a
    trace."""
    versions = f"fusionllm{_version('fusionllm')}-torch{_version('torch')}"
    name = f"costs-v{_COSTS_FORMAT}-{model}-{seq_len}-v{vocab_size}-{versions}.json"
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _read_costs(path: Path) -> GraphCosts | None:
    if not path.exists():
        return None
    try:
        return costs_from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("ignoring an unreadable costs cache %s: %s", path, exc)
        return None


def _ask_child(
    model: str,
    sizes: list[str],
    device_cache: Path | None,
    probe: list[str],
    timeout_s: float,
    model_dir: str | None,
    measure_device: bool,
) -> LocalFacts:
    """Run the facts child (node/control/facts_main.py) and check what it says."""
    argv = [sys.executable, "-m", "fusionllm.node.control.facts_main"]
    argv += ["--model", model, *sizes]
    if model_dir is not None:
        argv += ["--model-dir", model_dir]
    if device_cache is not None:
        argv += ["--device-cache", str(device_cache)]
    argv += probe
    with JsonChild(argv, name="facts") as child:
        try:
            reply = child.next_event(timeout_s)
        except (TimeoutError, EOFError) as exc:
            raise FactsError(f"the model/device probe gave no answer: {exc}") from exc
        child.wait(timeout=timeout_s)
    return parse_facts(reply, measure_device=measure_device)


def parse_facts(reply: Any, *, measure_device: bool) -> LocalFacts:
    """The child's one JSON line as LocalFacts; FactsError for an error or a malformed reply."""
    if not isinstance(reply, dict):
        raise FactsError(f"the model/device probe said {type(reply).__name__}, not a map")
    if "error" in reply:
        raise FactsError(f"the model/device probe failed: {str(reply['error'])[:500]}")
    try:
        costs = costs_from_json(reply["costs"])
        raw_device = reply["device"]
        device = DeviceInfo(**raw_device) if raw_device is not None else None
        raw_rehearsal = reply.get("rehearsal")
        rehearsal = Rehearsal.from_json(raw_rehearsal) if raw_rehearsal is not None else None
    except (KeyError, TypeError, ValueError) as exc:
        raise FactsError(f"the model/device probe's reply is malformed: {exc}") from exc
    if measure_device and device is None:
        raise FactsError("the model/device probe measured no device")
    return LocalFacts(device=device, costs=costs, rehearsal=rehearsal)
