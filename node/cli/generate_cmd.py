"""``fusionllm generate``: continue a prompt through a serving swarm, as a client."""

import argparse
import asyncio
import json
import sys
import time

from fusionllm.common.errors import ConfigError
from fusionllm.node.cli.keygen_cmd import add_swarm_key_option, swarm_key_of
from fusionllm.node.cli.options import add_swarm_address


def add_parser(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate text with a serving swarm (fusionllm node --task serve)",
        description="Finds the swarm's serving plan on its DHT as a client (it joins nothing), "
        "opens a session on each stage, sends the prompt through them, then one token at a "
        "time. Temperature 0 (the default) is greedy. A stage that dies mid-way is replaced "
        "by a replica or the re-planned route, and the tokens so far are replayed.",
    )
    add_swarm_address(gen, joining=False)
    add_swarm_key_option(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        help="text, tokenized with --model-dir's tokenizer.json (UTF-8 bytes for a byte-level "
        "model of 256 ids)",
    )
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated: 1,2,3")
    gen.add_argument(
        "--model-dir",
        metavar="DIR",
        help="a folder with the model's tokenizer.json: --prompt is tokenized and the output "
        "decoded with it (the weights are not read)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=32, help="(default: %(default)s)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default: %(default)s)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (%(default)s)")
    gen.add_argument("--seed", type=int, help="sampling seed (default: random)")
    gen.add_argument("--model", help="refuse a swarm that serves another model (folder name)")
    gen.add_argument(
        "--fp16-activations",
        action="store_true",
        help="send the residual stream between stages as fp16 (half the bytes; logits stay "
        "fp32, greedy output may differ from fp32 in rare near-ties)",
    )
    gen.add_argument(
        "--timeout", type=float, default=60.0, help="to connect, and to rebuild a route (s)"
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help='print {"output_ids", "text", "tokens_per_s", "first_token_s"}',
    )
    gen.set_defaults(handler=run)


def prompt_ids(args: argparse.Namespace, codec) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids must be ints: {args.prompt_ids!r}") from None
    if codec is None:
        raise ConfigError("--prompt needs the model's tokenizer: give --model-dir DIR (the "
                          "folder with its tokenizer.json), or --prompt-ids")  # fmt: skip
    return codec.encode(args.prompt)


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.serve.api import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    result = asyncio.run(_generate(args, params))
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"] if result["text"] is not None else result["output_ids"])
        print(
            f"{len(result['output_ids'])} tokens, first after {result['first_token_s']:.3f} s, "
            f"{result['tokens_per_s']:.1f} tokens/s",
            file=sys.stderr,
        )
    return 0


async def _generate(args, params) -> dict:
    from fusionllm.node.cli.gateway_cmd import codec_for
    from fusionllm.node.serve.client import connect_swarm

    source = await connect_swarm(
        args.bootstrap,
        model=args.model,
        timeout=args.timeout,
        swarm_key=swarm_key_of(args),
        swarm=args.swarm,
        fp16=args.fp16_activations,
    )
    try:
        codec = None
        if args.model_dir is not None or source.vocab_size == 256:
            codec = codec_for(args.model_dir, source.vocab_size)
        ids = prompt_ids(args, codec)
        began, first, out = time.monotonic(), None, []
        stream = source.stream(ids, params)
        try:
            async for token in stream:
                first = first if first is not None else time.monotonic() - began
                out.append(token)
        finally:
            await stream.aclose()
        took = time.monotonic() - began
    finally:
        await source.aclose()
    text = codec.decode(out) if codec is not None else None
    return {
        "output_ids": out,
        "text": text,
        "tokens_per_s": len(out) / took if took > 0 else 0.0,
        "first_token_s": first,
    }
