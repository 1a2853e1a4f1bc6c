"""A request's JSON body, read no further than a limit (the declared length is not trusted)."""

import json
from typing import Any

from starlette.requests import Request

from fusionllm.node.serve.openai_wire import RequestError


async def read_json_body(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past ``limit`` bytes (stops reading there), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested arrays
        raise RequestError(f"the body is not valid JSON: {exc}"[:300]) from exc


def _too_large(limit: int) -> RequestError:
    return RequestError(
        f"the request body is over {limit} bytes", status=413, code="body_too_large"
    )
