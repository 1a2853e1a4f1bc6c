"""Options shared by the commands that train: one run spec, one meaning for every flag."""

import argparse

from fusionllm.common.run_spec import GRADIENT_CODECS, MODELS, PRECISIONS, RunSpec


def add_run_options(parser: argparse.ArgumentParser, *, steps: int = 200) -> None:
    group = parser.add_argument_group(
        "run", "what is trained; every node of a swarm needs the same values"
    )
    group.add_argument("--model", default="tiny", choices=MODELS, help="GPT-2 preset (%(default)s)")
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
    group.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="compute precision (autocast); weights and optimizer state stay fp32. bf16 needs "
        "a recent GPU or runs slowly on CPUs (%(default)s)",
    )


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """--device: where this machine's stages compute (each node's own choice)."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N",
        help="where stages compute; auto: the first CUDA GPU if torch sees one, else the CPU "
        "(%(default)s)",
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
    return RunSpec(
        model=args.model,
        steps=args.steps,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        micro_batches=args.micro_batches,
        lr=args.lr,
        seed=args.seed,
        gradient_codec=args.gradient_codec,
        precision=args.precision,
    )
