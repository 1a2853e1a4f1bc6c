"""``fusionllm export``: the model a swarm trained, as a Hugging Face folder."""

import argparse
import json
from pathlib import Path

from fusionllm.common.errors import ConfigError


def add_parser(commands) -> None:
    export = commands.add_parser(
        "export",
        help="assemble the trained model from nodes' work dirs into a Hugging Face folder",
        description="Reads the stages' final parameters (or, for a run that did not finish, "
        "the newest step their checkpoints cover between them) from one or more work dirs: "
        "a `fusionllm swarm` work dir or the nodes' own. Writes config.json and "
        "model.safetensors, which transformers loads as GPT2LMHeadModel or LlamaForCausalLM. "
        "A stage that no work dir holds is an error that names it. With --merge: a base "
        "folder with LoRA adapters (PEFT's layout, as a fine-tune saves them) folded into "
        "its weights.",
    )
    export.add_argument(
        "--work-dir",
        nargs="+",
        metavar="DIR",
        help="a swarm's work dir, or node work dirs (between them, every stage)",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="write --model-dir's model with --adapter's LoRA adapters merged into it",
    )
    export.add_argument(
        "--adapter",
        metavar="DIR",
        help="with --merge: adapter_config.json + adapter_model.safetensors (PEFT's layout)",
    )
    export.add_argument(
        "--model-dir",
        metavar="DIR",
        help="with --merge: the base Hugging Face folder (default: the one the adapter's "
        "adapter_config.json names)",
    )
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    export.add_argument("--json", action="store_true", help="print where it wrote, as JSON")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    out = _merge(args) if args.merge else _assemble(args)
    if args.json:
        print(json.dumps({"out": str(out)}))
    else:
        print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


def _assemble(args: argparse.Namespace) -> Path:
    from fusionllm.node.training.export import export

    if not args.work_dir:
        raise ConfigError("export needs --work-dir (or --merge with --adapter)")
    return export([Path(d).expanduser() for d in args.work_dir], Path(args.out).expanduser())


def _merge(args: argparse.Namespace) -> Path:
    from fusionllm.dag.models.lora_io import export_merged, read_lora_config

    if args.adapter is None or args.work_dir:
        raise ConfigError("--merge takes --adapter DIR (and --model-dir), not --work-dir")
    adapter = Path(args.adapter).expanduser()
    model_dir = args.model_dir or read_lora_config(adapter)[1]
    if model_dir is None:
        raise ConfigError(f"{adapter}'s adapter_config.json names no base folder; give --model-dir")
    return export_merged(Path(model_dir).expanduser(), adapter, Path(args.out).expanduser())
