"""The status page's server: the static page and its JSON, read-only (starlette + uvicorn).

``status_app`` serves ``static/`` and ``/api/status`` (the feed's newest copy, so any number of
browsers cost one DHT read per interval). The page draws every peer-supplied string with
``textContent`` and the Content-Security-Policy allows scripts and styles from this server
only: a peer name that holds markup shows as text and can run nothing.
"""

import signal
import socket
from importlib import resources
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.node.observe.feed import StatusFeed

logger = get_logger(__name__)

_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def static_dir() -> Path:
    return Path(str(resources.files("fusionllm.node.observe") / "static"))


def status_app(feed: StatusFeed) -> Starlette:
    static = static_dir()

    async def index(request: Request) -> Response:
        return FileResponse(static / "index.html")

    async def api(request: Request) -> Response:
        return JSONResponse(feed.latest())

    return Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/api/status", api, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=static), name="static"),
        ],
        middleware=[Middleware(_Headers)],
    )


class _Headers:
    """The security headers on every response, the static files' and the errors' too."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, with_headers)


def listening_socket(host: str, port: int, *, option: str = "--serve") -> socket.socket:
    """Bound before the DHT starts, so a bad address or a taken port is a clear error
    (naming ``option``, the command's flag that gave the address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise FusionError(f"{option} {host}:{port}: cannot listen there: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise FusionError(f"{option} {host}:{port}: cannot listen there: {exc}") from exc
    return sock


def serve(app: Starlette, sock: socket.socket) -> None:
    """Serve until Ctrl-C or SIGTERM. uvicorn stops gracefully on either, then raises the
    signal again under the handler it found: for SIGTERM that is a no-op here, so the caller
    closes its DHT client and the command exits 0, as a node does on SIGTERM."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
