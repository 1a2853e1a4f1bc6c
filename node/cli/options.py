"""Options shared by the commands that train: one run spec, one meaning for every flag."""

import argparse
import functools
from pathlib import Path

from fusionllm.common.errors import ConfigError
from fusionllm.common.model_folder import model_folder_digest
from fusionllm.common.run_spec import FOLDER, GRADIENT_CODECS, MODELS, RunSpec

# A command reads its run spec more than once; a folder's bytes are hashed once.
_folder_digest = functools.cache(model_folder_digest)


def add_run_options(parser: argparse.ArgumentParser, *, steps: int = 200) -> None:
    group = parser.add_argument_group(
        "run", "what is trained; every node of a swarm needs the same values"
    )
    group.add_argument("--model", choices=MODELS, help="model preset (default: tiny)")
    group.add_argument(
        "--model-dir",
        metavar="DIR",
        help="train this Hugging Face folder (config.json + model.safetensors, GPT-2 or Llama) "
        "instead of a preset; every node needs the same files (their digest is compared)",
    )
    group.add_argument(
        "--steps", type=int, default=steps, help="optimizer steps, 0: no end (%(default)s)"
    )
    group.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (%(default)s)")
    group.add_argument(
        "--micro-batch-size", type=int, default=2, help="sequences per micro-batch (%(default)s)"
    )
    group.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches per step, scheduled 1F1B; a step trains micro-batch-size x "
        "micro-batches sequences whatever the plan (%(default)s)",
    )
    group.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (%(default)s)")
    group.add_argument(
        "--seed", type=int, default=0, help="model init and data order (%(default)s)"
    )
    group.add_argument(
        "--gradient-codec",
        choices=GRADIENT_CODECS,
        default="topk",
        help="gradient code on compressed links, with error feedback (%(default)s)",
    )


def add_swarm_address(parser: argparse.ArgumentParser, *, joining: bool) -> None:
    """--swarm and --bootstrap: which swarm, and where to reach it."""
    parser.add_argument("--swarm", default="default", help="swarm name (default: %(default)s)")
    parser.add_argument(
        "--bootstrap",
        nargs="+",
        required=not joining,
        metavar="MADDR",
        help="DHT multiaddr(s) of any node in the swarm (each node prints its own)"
        + ("; omit to start a new swarm" if joining else ""),
    )


def run_spec_from(args: argparse.Namespace) -> RunSpec:
    model, digest, model_dir = args.model or "tiny", "", None
    if args.model_dir is not None:
        if args.model is not None:
            raise ConfigError("give --model or --model-dir, not both")
        model_dir = str(Path(args.model_dir).expanduser().resolve())
        model, digest = FOLDER, _folder_digest(model_dir)
    return RunSpec(
        model=model,
        model_digest=digest,
        model_dir=model_dir,
        steps=args.steps,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches,
        lr=args.lr,
        seed=args.seed,
        gradient_codec=args.gradient_codec,
    )
