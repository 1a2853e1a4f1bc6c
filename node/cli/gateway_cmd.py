"""``fusionllm gateway``: an OpenAI-compatible HTTP endpoint in front of a swarm or a local model.

The source is the swarm's client (``--bootstrap``) or a model in this process
(``--local-model-dir``); text goes through ``TextCodec`` (``--model-dir``'s tokenizer.json, or
UTF-8 bytes for byte-level models). Both sources are imported only when asked for, so the
command's help and its errors work without them.
"""

import argparse
import asyncio
from pathlib import Path

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.node.cli.keygen_cmd import add_swarm_key_option, swarm_key_of
from fusionllm.node.observe.listen import listen_arg, url_of

logger = get_logger(__name__)


def add_parser(commands) -> None:
    gateway = commands.add_parser(
        "gateway",
        help="serve an OpenAI-compatible HTTP API (completions, chat, streaming) from a swarm",
        description="Answers /v1/models, /v1/completions and /v1/chat/completions (with "
        '"stream": true as server-sent events) from a serving swarm (--bootstrap) or from '
        "a model run in this process (--local-model-dir). Requests beyond the limits below "
        "get OpenAI's error shape: 400, 404 (unknown model), 413 (body), 429 (busy), "
        "503 (the swarm cannot answer).",
    )
    where = gateway.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--bootstrap", nargs="+", metavar="MADDR", help="DHT multiaddr(s) of the swarm"
    )
    where.add_argument(
        "--local-model-dir", metavar="DIR", help="serve this Hugging Face folder in this process"
    )
    gateway.add_argument(
        "--http",
        metavar="HOST:PORT",
        type=listen_arg,
        default=("127.0.0.1", 8000),
        help="where to listen (default: 127.0.0.1:8000; port 0: a free one, printed)",
    )
    gateway.add_argument(
        "--model-dir",
        metavar="DIR",
        help="the folder with the model's tokenizer.json (default: --local-model-dir; without "
        "one, text is UTF-8 bytes, for byte-level models)",
    )
    gateway.add_argument("--model", help="with --bootstrap: the served model to use")
    gateway.add_argument(
        "--timeout", type=float, default=60.0, help="s to find the swarm (default: %(default)s)"
    )
    add_swarm_key_option(gateway)
    _add_limits(gateway)
    gateway.set_defaults(handler=run)


def _add_limits(parser: argparse.ArgumentParser) -> None:
    from fusionllm.node.serve.gateway_config import GatewayLimits

    limits = parser.add_argument_group("limits (a request beyond one is refused)")
    defaults = GatewayLimits()
    for flag, field, what in (
        ("--max-concurrent", "max_concurrent", "requests generating at once (more get 429)"),
        ("--max-tokens", "max_tokens", "max_tokens a request may ask for"),
        ("--max-prompt-tokens", "max_prompt_tokens", "tokens in a prompt"),
        ("--max-body-bytes", "max_body_bytes", "bytes in a request body"),
    ):
        default = getattr(defaults, field)
        limits.add_argument(
            flag, type=int, metavar="N", default=default, help=f"{what} (default: {default})"
        )
    limits.add_argument(
        "--idle-timeout",
        type=float,
        metavar="S",
        default=defaults.idle_timeout_s,
        help="fail a request (504) whose next token takes longer than this "
        f"(default: {defaults.idle_timeout_s:g} s)",
    )


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.observe.page import listening_socket
    from fusionllm.node.serve.gateway_config import GatewayLimits

    limits = GatewayLimits(
        max_concurrent=args.max_concurrent,
        max_tokens=args.max_tokens,
        default_max_tokens=min(GatewayLimits().default_max_tokens, args.max_tokens),
        max_prompt_tokens=args.max_prompt_tokens,
        max_body_bytes=args.max_body_bytes,
        idle_timeout_s=args.idle_timeout,
    )
    tokenizer_dir = args.model_dir or args.local_model_dir
    sock = listening_socket(*args.http, option="--http")  # a taken port fails before the swarm
    try:
        asyncio.run(_serve(args, limits, tokenizer_dir, sock))
    finally:
        sock.close()
    return 0


async def _serve(args: argparse.Namespace, limits, tokenizer_dir: str | None, sock) -> None:
    from fusionllm.node.serve.gateway import gateway_app
    from fusionllm.node.serve.gateway_server import serve_gateway

    source = await _open_source(args)
    try:
        codec = codec_for(tokenizer_dir, source.vocab_size)
        app = gateway_app(source, codec, limits=limits)
        host, port = sock.getsockname()[:2]
        print(
            f"gateway: {source.model_name!r} at {url_of(host, port, '/v1')} (text: {codec.name}; "
            f"at most {limits.max_concurrent} requests at once; Ctrl-C stops)",
            flush=True,
        )
        await serve_gateway(app, sock)
    finally:
        await source.aclose()


def codec_for(tokenizer_dir: str | None, vocab_size: int):
    """The folder's TextCodec; with no folder, UTF-8 bytes for a model of exactly 256 ids (our
    byte presets): a larger vocabulary has a tokenizer, and bytes would make it talk nonsense."""
    from fusionllm.node.serve.text import BYTE_VOCAB, TextCodec

    if tokenizer_dir is not None:
        return TextCodec.from_model_folder(Path(tokenizer_dir).expanduser())
    if vocab_size != BYTE_VOCAB:
        raise ConfigError(
            f"the model's vocabulary ({vocab_size}) is not byte-level ({BYTE_VOCAB}): give "
            "--model-dir, the folder with its tokenizer.json"
        )
    return TextCodec.byte_level()


async def _open_source(args: argparse.Namespace):
    if args.local_model_dir is not None:
        from fusionllm.node.serve.local import LocalSource

        return LocalSource.from_folder(Path(args.local_model_dir).expanduser())
    from fusionllm.node.serve.client import connect_swarm

    return await connect_swarm(
        args.bootstrap, model=args.model, timeout=args.timeout, swarm_key=swarm_key_of(args)
    )
