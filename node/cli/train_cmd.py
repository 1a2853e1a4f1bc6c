"""``fusionllm train``: GPT-2 in a local swarm of stage processes on 127.0.0.1."""

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from fusionllm.node.cli.config import add_config_option
from fusionllm.node.cli.options import (
    add_device_option,
    add_run_options,
    add_task_options,
    load_data,
    run_spec_from,
)

if TYPE_CHECKING:
    from fusionllm.node.pipeline.train_config import TrainConfig


def add_parser(commands) -> None:
    train = commands.add_parser(
        "train",
        help="reference run: a launcher starts one stage process each on 127.0.0.1 (no daemons)",
        description="Starts one process per pipeline stage (and replica) on this machine, "
        "connected over the real transport, and trains a byte-level GPT-2 on the Python "
        "standard library's source (or your token file). Ctrl-C stops every process.",
    )
    train.add_argument(
        "--stages",
        type=int,
        default=2,
        help="pipeline stages, a process each (default: %(default)s)",
    )
    train.add_argument(
        "--replicas", type=int, nargs="+", help="data-parallel replicas per stage, e.g. 1 2"
    )
    add_run_options(train)
    add_task_options(train)
    train.add_argument(
        "--adapter-out",
        default="adapter",
        metavar="DIR",
        help="--task finetune: where the trained adapters go, in PEFT's layout (%(default)s)",
    )
    add_device_option(train)
    train.add_argument(
        "--data",
        help="uint16/uint32 token file or a `fusionllm prepare` directory (default: stdlib "
        "source bytes)",
    )
    train.add_argument(
        "--data-dtype",
        choices=["uint16", "uint32"],
        help="element type of a --data file (default: uint16; a directory's manifest says)",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        help="model vocabulary; --data token ids must be below it (default: the data's: "
        "256 for bytes, a manifest's, a token file's largest id + 1)",
    )
    train.add_argument(
        "--topk-ratio",
        type=float,
        default=1.0,
        help="top-k ratio on every link's gradients, with error feedback (default: dense)",
    )
    train.add_argument(
        "--topk-activations",
        action="store_true",
        help="compress activations too, within --topk-ratio's bytes (a ternary code of every "
        "element while it fits, else top-k)",
    )
    train.add_argument(
        "--every", type=int, default=10, help="print every N steps (default: %(default)s)"
    )
    train.add_argument("--json", action="store_true", help="one JSON line per step")
    add_config_option(train)  # last: it names every option above
    train.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.devices import resolve_device
    from fusionllm.node.pipeline.launcher import run_swarm

    config = _train_config(args)
    device = str(resolve_device(args.device))  # a clear error here, not one per stage process
    processes = sum(config.stage_replicas)
    if not args.json:
        print(
            f"training {config.model_dir or config.model} in {config.stages} stages "
            f"({processes} processes on 127.0.0.1), {config.micro_batches} micro-batches x "
            f"{config.batch_size} x {config.seq_len} tokens per step, {config.precision} on "
            f"{device}, data: {config.data_path or 'stdlib source'}",
            flush=True,
        )

    def on_step(event: dict) -> None:
        tokens_per_s = config.tokens_per_step / max(event["seconds"], 1e-9)
        if args.json:
            print(json.dumps({"step": event["step"], "loss": event["loss"],
                              "eval_loss": event.get("eval_loss"),
                              "tokens_per_s": tokens_per_s}), flush=True)  # fmt: skip
            return
        if event.get("eval_loss") is not None:
            print(f"step {event['step']:>5}  validation loss {event['eval_loss']:.4f}", flush=True)
        if event["step"] % args.every == 0 or event["step"] == config.steps - 1:
            print(
                f"step {event['step']:>5}  loss {event['loss']:.4f}  "
                f"grad norm {event['grad_norm']:.3f}  {tokens_per_s:,.0f} tokens/s",
                flush=True,
            )

    # The stages log to this terminal too: only warnings, unless debugging.
    stage_log_level = "DEBUG" if args.log_level == "DEBUG" else "WARNING"
    result = run_swarm(config, on_step=on_step, log_level=stage_log_level, device=device)
    if not args.json:
        print(
            f"done: {config.steps} steps in {result.seconds:.1f}s, "
            f"final loss {result.losses[-1]:.4f}"
        )
    if config.lora is not None:
        out = _save_adapters(config, result.parameters, Path(args.adapter_out).expanduser())
        print(json.dumps({"adapter": str(out)}) if args.json else f"adapters (PEFT): {out}")
    return 0


def _save_adapters(config: "TrainConfig", trained: dict, out: Path) -> Path:
    """The run's adapters in PEFT's layout: what the stages trained, and LoRA-FA's A (never
    trained, so no stage returns it) drawn again from the run's seed."""
    import torch

    from fusionllm.dag.models import registry
    from fusionllm.dag.models.lora import with_frozen_a
    from fusionllm.dag.models.lora_io import adapter_shapes, save_adapters
    from fusionllm.node.pipeline.train_config import model_config

    assert config.lora is not None
    with torch.device("meta"):
        plain = registry.build(model_config(config))
    every = with_frozen_a(adapter_shapes(plain, config.lora), trained, config.seed)
    return save_adapters(plain, config.lora, every, out, base=config.model_dir)


def _train_config(args: argparse.Namespace) -> "TrainConfig":
    from fusionllm.node.pipeline.train_config import TrainConfig

    links = args.stages - 1
    ratio = (args.topk_ratio,) * links if args.topk_ratio < 1.0 and links else ()
    run = run_spec_from(args, load_data(args))  # checked here, not in every stage process
    return TrainConfig.for_run(
        run,
        cuts=None,
        stages=args.stages,
        replicas=tuple(args.replicas) if args.replicas else None,
        steps=run.steps,  # 0 is refused: train runs to an end
        activation_ratios=ratio if args.topk_activations else (),
        gradient_ratios=ratio,
        data_path=args.data,
        data_dtype=args.data_dtype,
    )
