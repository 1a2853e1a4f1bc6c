"""The child that learns what a node needs torch for before it trains: one JSON line, then exit.

    python -m fusionllm.node.control.facts_main --model M --seq-len T [--vocab-size V]
        [--model-dir D] [--device-cache P] [--no-device]  (started by local_facts.learn_local_facts)

It prints {"device": DeviceInfo fields or null, "costs": the model's graph costs}, or
{"error": "..."} and exits 1. The node's own process plans from these and never imports torch
(~200 MiB RSS) until it serves a stage.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import configure_logging
from fusionllm.common.run_spec import STDLIB_VOCAB
from fusionllm.dag.graph import GraphCosts, costs_to_json
from fusionllm.dag.models import read_config, registry
from fusionllm.dag.tracing import trace
from fusionllm.node.control.probe import local_device


def model_costs(
    model: str, seq_len: int, model_dir: str | None = None, *, vocab_size: int = STDLIB_VOCAB
) -> GraphCosts:
    """The run's model traced at one sequence of ``seq_len`` tokens, on meta: shapes only, so
    it allocates nothing even for gpt2-xl (a folder's config.json is read, not its weights).
    A preset gets the run's ``vocab_size`` (the data's), as every stage builds it; a folder
    keeps its own, which may exceed the data's."""
    config = (
        read_config(model_dir)
        if model_dir is not None
        else registry.preset_config(model, vocab_size=vocab_size)
    )
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
    print(json.dumps({"device": device, "costs": costs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
