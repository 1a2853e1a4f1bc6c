"""The child that learns what a node needs torch for before it trains: one JSON line, then exit.

    python -m fusionllm.node.control.facts_main --model M --seq-len T [--vocab-size V]
        [--model-dir D] [--device-cache P] [--no-device] [--device DEV] [--precision P]
        [--rehearse-s S --micro-batch-size B --micro-batches M]
        (started by local_facts.learn_local_facts)

It prints {"device": DeviceInfo fields or null, "costs": the model's graph costs, "rehearsal":
a rehearsal's fields (rehearsal.py) or null}, or {"error": "..."} and exits 1. A rehearsal
that fails is logged and left out: the node plans on its device's model, as before. The
node's own process plans from these and never imports torch (~200 MiB RSS) until it serves a
stage.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging, get_logger
from fusionllm.common.run_spec import STDLIB_VOCAB
from fusionllm.dag.graph import GraphCosts, costs_to_json
from fusionllm.dag.models import read_config, registry
from fusionllm.dag.tracing import trace
from fusionllm.node.control.probe import local_device
from fusionllm.node.control.rehearsal import RehearsalConfig, rehearse
from fusionllm.node.pipeline.compute import Compute

logger = get_logger(__name__)


def architecture(
    model: str, model_dir: str | None = None, *, vocab_size: int = STDLIB_VOCAB
) -> Any:
    """The run's model config: a preset at the run's ``vocab_size`` (the data's), as every
    stage builds it; a folder's own config.json, whose vocabulary may exceed the data's."""
    if model_dir is not None:
        return read_config(model_dir)
    return registry.preset_config(model, vocab_size=vocab_size)


def model_costs(
    model: str, seq_len: int, model_dir: str | None = None, *, vocab_size: int = STDLIB_VOCAB
) -> GraphCosts:
    """The run's model traced at one sequence of ``seq_len`` tokens, on meta: shapes only, so
    it allocates nothing even for gpt2-xl (a folder's config.json is read, not its weights)."""
    config = architecture(model, model_dir, vocab_size=vocab_size)
    with torch.device("meta"):
        module = registry.build(config)
    example = registry.example_input(1, seq_len)  # (B=1, T)
    return trace(module, (example,)).costs()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, default=STDLIB_VOCAB, help="a preset's")
    parser.add_argument("--model-dir", help="the Hugging Face folder, for model 'folder'")
    parser.add_argument("--device-cache", type=Path)
    parser.add_argument("--no-device", action="store_true", help="the device is known already")
    parser.add_argument("--device", default="auto", help="the device to measure (auto)")
    parser.add_argument("--precision", default="fp32", help="the run's precision (fp32)")
    parser.add_argument("--rehearse-s", type=float, default=0.0, help="time the first stage")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="... at this shape")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args(argv)
    configure_logging("INFO")  # the first measurement says what it found
    try:
        device = (
            None
            if args.no_device
            else asdict(local_device(args.device_cache, args.device, args.precision))
        )
        costs = costs_to_json(
            model_costs(args.model, args.seq_len, args.model_dir, vocab_size=args.vocab_size)
        )
    except (FusionError, ValueError, RuntimeError, OSError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    rehearsal = _rehearsal(args) if args.rehearse_s > 0 else None
    print(json.dumps({"device": device, "costs": costs, "rehearsal": rehearsal}), flush=True)
    return 0


def _rehearsal(args: argparse.Namespace) -> dict[str, Any] | None:
    """The rehearsal's fields, or None where it failed (said in the log): a node whose first
    stage cannot be timed here plans on its device's model, as it did before rehearsals."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = RehearsalConfig(
            seconds=args.rehearse_s, batch=args.micro_batch_size, seq_len=args.seq_len,
            micro_batches=args.micro_batches,
        )  # fmt: skip
        model = architecture(args.model, args.model_dir, vocab_size=args.vocab_size)
        done = rehearse(model, config, Compute.of(args.device, args.precision))
    except (FusionError, ValueError, RuntimeError, OSError) as exc:
        logger.warning("could not rehearse the run's first stage: %s: %s", type(exc).__name__, exc)
        return None
    logger.info("rehearsed the run's first %d operators: %d steps of %.3g s", done.stop,
                done.steps, done.step_s)  # fmt: skip
    return done.to_json()


if __name__ == "__main__":
    sys.exit(main())
