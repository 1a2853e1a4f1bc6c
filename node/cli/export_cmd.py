"""``fusionllm export``: the model a swarm trained, as a Hugging Face folder."""

import argparse
import json
from pathlib import Path


def add_parser(commands) -> None:
    export = commands.add_parser(
        "export",
        help="assemble the trained model from nodes' work dirs into a Hugging Face folder",
        description="Reads the stages' final parameters (or, for a run that did not finish, "
        "the newest step their checkpoints cover between them) from one or more work dirs: "
        "a `fusionllm swarm` work dir or the nodes' own. Writes config.json and "
        "model.safetensors, which transformers loads as GPT2LMHeadModel or LlamaForCausalLM. "
        "A stage that no work dir holds is an error that names it.",
    )
    export.add_argument(
        "--work-dir",
        nargs="+",
        required=True,
        metavar="DIR",
        help="a swarm's work dir, or node work dirs (between them, every stage)",
    )
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    export.add_argument("--json", action="store_true", help="print where it wrote, as JSON")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.training.export import export

    dirs = [Path(d).expanduser() for d in args.work_dir]
    out = export(dirs, Path(args.out).expanduser())
    if args.json:
        print(json.dumps({"out": str(out)}))
    else:
        print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0
