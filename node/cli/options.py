"""Options shared by the commands that train: one run spec, one meaning for every flag."""

import argparse
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.common.model_folder import model_folder_digest
from fusionllm.common.run_spec import FOLDER, GRADIENT_CODECS, MODELS, PRECISIONS, RunSpec

# A command reads its run spec more than once; a folder's bytes are hashed once.
_folder_digest = functools.cache(model_folder_digest)

if TYPE_CHECKING:
    from fusionllm.data.corpus import Corpus

logger = get_logger(__name__)


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
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="every N steps, the loss on a held-out split of the data (its last 1%%), shown "
        "in the events, `fusionllm status` and the summary; 0: never (%(default)s)",
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


def add_task_options(
    parser: argparse.ArgumentParser, tasks: tuple[str, ...] = ("train", "finetune")
) -> None:
    """--task and the adapter options of ``--task finetune`` (part of the run: every node of a
    swarm needs the same values, and nodes with other adapters are never planned together)."""
    group = parser.add_argument_group(
        "task",
        "what the run does; the --lora-* options are for --task finetune (the model's "
        "weights frozen, low-rank adapters trained)",
    )
    group.add_argument(
        "--task",
        choices=tasks,
        default="train",
        help="train: every parameter; finetune: LoRA adapters only, saved in PEFT's layout; "
        "serve (node only): generation of a --model-dir checkpoint for clients (fusionllm "
        "generate, gateway), each node holding only its stage's blocks (default: %(default)s)",
    )
    group.add_argument("--lora-rank", type=int, metavar="R", help="adapter rank (finetune)")
    group.add_argument(
        "--lora-alpha",
        type=float,
        metavar="A",
        help="adapter scale alpha; the update is (alpha / R) B A x (default: R)",
    )
    group.add_argument(
        "--lora-fa",
        action="store_true",
        help="LoRA-FA: A frozen at its seeded init, only B trained; keeps R numbers per token "
        "for backward instead of the layer's input",
    )
    group.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated layer names to adapt, e.g. c_attn,c_proj (default: every "
        "linear layer of a block: c_attn,c_proj,c_fc for GPT-2, q/k/v/o/gate/up/down_proj "
        "for Llama)",
    )


def lora_fields(args: argparse.Namespace) -> dict:
    """The run spec's LoRA fields from --task and the --lora-* options, or {} (train)."""
    task = getattr(args, "task", "train")
    given = [
        flag
        for flag, value in (
            ("--lora-rank", getattr(args, "lora_rank", None)),
            ("--lora-alpha", getattr(args, "lora_alpha", None)),
            ("--lora-fa", getattr(args, "lora_fa", False) or None),
            ("--lora-targets", getattr(args, "lora_targets", None)),
        )
        if value is not None
    ]
    if task != "finetune":
        if given:
            raise ConfigError(f"{', '.join(given)} need --task finetune")
        return {}
    if args.lora_rank is None:
        raise ConfigError("--task finetune needs --lora-rank R (e.g. 8)")
    targets = tuple(t.strip() for t in (args.lora_targets or "").split(",") if t.strip())
    return {
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha or 0.0,
        "lora_fa": bool(args.lora_fa),
        "lora_targets": targets,
    }


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """--device: where this machine's stages compute (each node's own choice)."""
    parser.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N",
        help="where stages compute; auto: the first CUDA GPU if torch sees one, else the CPU "
        "(%(default)s)",
    )


def add_data_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "data",
        "what is trained on; every node of a swarm needs the same tokens (their digest is "
        "compared, not the path: a node whose data differs is never planned with the others)",
    )
    group.add_argument(
        "--data",
        metavar="PATH",
        help="a flat token file (little-endian uint16/uint32 ids, as nanoGPT's prepare scripts "
        "write) or a directory written by `fusionllm prepare` (default: the bytes of this "
        "Python's standard library source)",
    )
    group.add_argument(
        "--data-dtype",
        choices=["uint16", "uint32"],
        help="element type of a --data token file (default: uint16; a prepared directory's "
        "manifest says)",
    )
    group.add_argument(
        "--vocab-size",
        type=int,
        help="vocabulary of the data, token ids below it (default: a prepared directory's "
        "manifest, a token file's largest id + 1, 256 for the stdlib bytes)",
    )


def load_data(args: argparse.Namespace) -> "Corpus":
    """The corpus the data options name, read through once: validated and digested."""
    from fusionllm.data.corpus import load_corpus

    started = time.monotonic()
    corpus = load_corpus(args.data, dtype=args.data_dtype, vocab_size=args.vocab_size)
    seconds = time.monotonic() - started
    logger.info("data %s: %d tokens, vocabulary %d, digest %s (%.1f s)", corpus.source,
                len(corpus), corpus.vocab_size, corpus.digest[:16], seconds)  # fmt: skip
    return corpus


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


def run_spec_from(args: argparse.Namespace, corpus: "Corpus | None" = None) -> RunSpec:
    """The run the options name; with ``corpus``, pinned to its digest and vocabulary."""
    data = {} if corpus is None else {"data_digest": corpus.digest, "vocab_size": corpus.vocab_size}
    model, digest, model_dir = args.model or "tiny", "", None
    if args.model_dir is not None:
        if args.model is not None:
            raise ConfigError("give --model or --model-dir, not both")
        model_dir = str(Path(args.model_dir).expanduser().resolve())
        model, digest = FOLDER, _folder_digest(model_dir)
    run = RunSpec(
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
        eval_every=args.eval_every,
        **data,
        precision=args.precision,
        **lora_fields(args),
    )
    if corpus is not None:  # enough data for a step, and for a validation batch
        from fusionllm.data.sampler import Sampler

        sampler = Sampler(
            tokens=len(corpus),
            seq_len=run.seq_len,
            seed=run.seed,
            batch_size=run.micro_batch_size,
            micro_batches=run.micro_batches,
        )
        if run.eval_every:
            sampler.eval_batch(0)
        _check_adapters(run)
    return run


def _check_adapters(run: RunSpec) -> None:
    """LoRA targets the model lacks are one error here, not one from every stage later: the
    adapted model is built on meta (shapes only, no weights read)."""
    if not run.lora_rank:
        return
    from fusionllm.node.pipeline.train_config import TrainConfig, build_model

    build_model(TrainConfig.for_run(run, cuts=(), replicas=(1,)), meta=True)
