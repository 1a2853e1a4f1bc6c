"""A gateway process for tests: a Hugging Face folder served by ``RecomputeSource``.

``python -m tests.support.gateway_main DIR [--max-concurrent N] [--token-delay S]`` serves on a
free port of 127.0.0.1 and prints one JSON line, ``{"url": ...}``, once it listens. Beside the
gateway's routes, ``GET /test/sessions`` says how many sessions the source opened, and how many
ids each closed one yielded.
"""

import argparse
import asyncio
import json

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse

from fusionllm.dag.models.pretrained import from_pretrained
from fusionllm.node.observe.page import listening_socket
from fusionllm.node.serve.gateway import gateway_app
from fusionllm.node.serve.gateway_config import GatewayLimits
from fusionllm.node.serve.gateway_server import serve_gateway
from fusionllm.node.serve.text import TextCodec
from tests.support.recompute_source import RecomputeSource


async def _main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    source = RecomputeSource(
        from_pretrained(args.model_dir), name="test-model", token_delay_s=args.token_delay
    )
    limits = GatewayLimits(max_concurrent=args.max_concurrent, max_body_bytes=args.max_body_bytes)
    app = gateway_app(source, TextCodec.from_model_folder(args.model_dir), limits=limits)

    async def sessions(request: Request) -> JSONResponse:
        return JSONResponse({"opened": source.opened, "lengths": source.lengths})

    app.add_route("/test/sessions", sessions, methods=["GET"])
    sock = listening_socket("127.0.0.1", 0, option="--http")
    print(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
    await serve_gateway(app, sock)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--max-concurrent", type=int, default=4)
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--token-delay", type=float, default=0.0)
    asyncio.run(_main(parser.parse_args()))
