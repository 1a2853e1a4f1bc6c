"""``fusionllm prepare``: the user's text into token shards a node trains on (``--data DIR``)."""

import argparse
import sys
from pathlib import Path


def add_parser(commands) -> None:
    prepare = commands.add_parser(
        "prepare",
        help="tokenize text and .jsonl files into token shards for --data",
        description="Reads text files and .jsonl files (one JSON object a line, its text in "
        "a 'text' field), a chunk at a time, and writes token shards (flat little-endian "
        "uint16, or uint32 for a vocabulary over 65,536) and a manifest.json (digest, token "
        "count, dtype, vocabulary) into --out. Byte-level tokens by default (vocabulary 256); "
        "--tokenizer reads a local Hugging Face tokenizer.json, nothing is downloaded. An "
        "input that cannot be read stops it with no shard left behind. Then train on it: "
        "fusionllm swarm --data OUT (every node of a swarm needs the same OUT: its digest "
        "joins the swarm's settings).",
    )
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help="text or .jsonl files")
    prepare.add_argument("--out", required=True, help="directory to write (new or empty)")
    prepare.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a tokenizer.json, or a directory holding one (default: bytes, vocabulary 256)",
    )
    prepare.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 24,
        help="tokens per shard file; bounds memory too (default: %(default)s)",
    )
    prepare.add_argument("--json", action="store_true", help="print the manifest as JSON")
    prepare.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fusionllm.data.prepare import PrepareConfig, check_inputs, prepare

    config = PrepareConfig(
        inputs=tuple(Path(p).expanduser() for p in args.inputs),
        out=Path(args.out).expanduser(),
        tokenizer=Path(args.tokenizer).expanduser() if args.tokenizer else None,
        shard_tokens=args.shard_tokens,
    )
    total = check_inputs(config)  # before the bar: a missing input is a one-line error
    with tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, desc="prepare") as bar:
        manifest = prepare(config, progress=bar.update)
    if args.json:
        print(manifest.to_json())
        return 0
    print(
        f"{manifest.tokens:,} tokens ({manifest.dtype}, vocabulary {manifest.vocab_size:,}) in "
        f"{len(manifest.shards)} shard(s) under {config.out}\n"
        f"digest {manifest.digest}\n"
        f"train on it: fusionllm swarm --data {config.out}"
    )
    return 0
