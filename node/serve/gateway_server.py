"""The gateway's HTTP server: uvicorn on a socket bound beforehand, in the caller's event loop.

The source (a swarm client) lives in the same loop as the app that streams from it, so the
server runs inside ``asyncio.run`` of whoever built the source, not in uvicorn's own loop.
"""

import socket

import uvicorn
from starlette.applications import Starlette

# An idle keep-alive connection is closed after this long (uvicorn's default is 5 s; SDK
# clients reuse connections between requests).
KEEP_ALIVE_S = 30


async def serve_gateway(app: Starlette, sock: socket.socket) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn stops gracefully on either)."""
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_S,
        # the proxy headers are a client's word: a gateway behind no proxy must not trust them
        proxy_headers=False,
    )
    await uvicorn.Server(config).serve(sockets=[sock])
