"""The OpenAI-compatible HTTP gateway: ``gateway_app`` over any ``TokenSource`` (starlette).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending ``data: [DONE]``), ``GET /health``. Requests are
held to ``GatewayLimits``: body bytes, prompt tokens, max_tokens, and requests generating at
once (the next one is refused with 429, not queued). Every refusal has OpenAI's error shape.
A client that disconnects mid-stream has its session closed (the source's stream is closed).
"""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fusionllm.common.errors import ConfigError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.node.serve.api import (
    MAX_NEW_TOKENS,
    OverloadedError,
    SamplingParams,
    ServeError,
    TokenSource,
    check_prompt,
)
from fusionllm.node.serve.gateway_body import read_json_body
from fusionllm.node.serve.gateway_config import GatewayLimits
from fusionllm.node.serve.openai_replies import DONE, Reply, event
from fusionllm.node.serve.openai_wire import (
    GenerationRequest,
    RequestError,
    error_body,
    parse_chat,
    parse_completion,
    too_long,
)
from fusionllm.node.serve.text import TextCodec
from fusionllm.node.serve.textgen import Piece, generate_text, with_idle_timeout

logger = get_logger(__name__)

Parser = Callable[[Any, GatewayLimits], GenerationRequest]


class Slots:
    """Requests generating now, at most ``limit``; a request beyond it is refused, not queued."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def try_acquire(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1


@dataclass(frozen=True)
class _Job:
    """A checked request, ready to run."""

    request: GenerationRequest
    reply: Reply
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]


def gateway_app(
    source: TokenSource, codec: TextCodec, *, limits: GatewayLimits | None = None
) -> Starlette:
    """The ASGI app; ``codec`` turns text into the source's ids and back."""
    if codec.vocab_size > source.vocab_size:
        raise ConfigError(
            f"the tokenizer's vocabulary ({codec.vocab_size}) is larger than the model's "
            f"({source.vocab_size}): are they from the same model?"
        )
    limits = limits or GatewayLimits()
    if limits.max_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"max_tokens limit {limits.max_tokens} is over {MAX_NEW_TOKENS}")
    gateway = _Gateway(source, codec, limits)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind=kind), status_code=exc.status_code)

    async def on_bug(request: Request, exc: Exception) -> Response:
        # starlette logs the traceback; the client gets the shape it parses, not the detail
        return JSONResponse(error_body("internal error", kind="server_error"), status_code=500)

    return Starlette(
        routes=[
            Route("/v1/models", gateway.models, methods=["GET"]),
            Route("/v1/completions", gateway.completions, methods=["POST"]),
            Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
            Route("/health", gateway.health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: on_http_error, Exception: on_bug},
    )


class _Gateway:
    def __init__(self, source: TokenSource, codec: TextCodec, limits: GatewayLimits) -> None:
        self.source, self.codec, self.limits = source, codec, limits
        self.slots = Slots(limits.max_concurrent)

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.source.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fusionllm",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model": self.source.model_name,
                "in_flight": self.slots.in_flight,
                "limit": self.slots.limit,
            }
        )

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, parse_completion, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, parse_chat, chat=True)

    async def _answer(self, request: Request, parse: Parser, *, chat: bool) -> Response:
        try:
            body = await read_json_body(request, self.limits.max_body_bytes)
            job = await self._job(parse(body, self.limits), chat=chat)
        except RequestError as exc:
            return _error(exc)
        if not self.slots.try_acquire():
            return _error(
                RequestError(
                    f"{self.slots.in_flight} requests are generating, the most this server "
                    "takes at once; retry later",
                    status=429,
                    kind="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            )
        pieces = with_idle_timeout(
            generate_text(
                self.source, self.codec.stream_decoder(), job.prompt_ids, job.params, job.stops
            ),
            self.limits.idle_timeout_s,
        )
        try:
            first = await _first_piece(pieces)
        except BaseException as exc:  # a cancelled request too must give its slot back
            self.slots.release()
            if isinstance(exc, RequestError):
                return _error(exc)
            raise
        if job.request.stream:
            # The slot and the session now belong to the response: _Stream frees both.
            return _Stream(_events(job, first, pieces), pieces, release=self.slots.release)
        try:
            return await _whole(job, first, pieces, request)
        finally:
            self.slots.release()

    async def _job(self, request: GenerationRequest, *, chat: bool) -> _Job:
        if request.model != self.source.model_name:
            raise RequestError(
                f"the model {request.model!r} is not served here; this server serves "
                f"{self.source.model_name!r}",
                param="model",
                status=404,
                kind="not_found_error",
                code="model_not_found",
            )
        stops = request.stop + (self.codec.chat.stop_strings if chat else ())
        param = "messages" if chat else "prompt"
        if request.prompt_ids is not None:
            prompt_ids = list(request.prompt_ids)
        else:
            text = self.codec.chat.render(request.messages) if chat else request.prompt_text
            # Tokenizing up to a body's worth of text takes a while: off the event loop.
            prompt_ids = await anyio.to_thread.run_sync(self.codec.encode, text)
        max_tokens = self._max_tokens(prompt_ids, request, param, chat=chat)
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                stop_ids=self.codec.eos_ids,
            )
            check_prompt(prompt_ids, params, self.source)
        except ConfigError as exc:  # ids outside the model's vocabulary
            raise RequestError(str(exc), param=param) from exc
        reply = Reply.new(chat=chat, model=self.source.model_name)
        return _Job(request, reply, prompt_ids, params, stops)

    def _max_tokens(
        self, prompt_ids: list[int], request: GenerationRequest, param: str, *, chat: bool
    ) -> int:
        """The request's max_tokens, or the endpoint's default cut to what the context holds;
        a prompt and max_tokens the context cannot hold are refused, naming which is at fault."""
        if len(prompt_ids) > self.limits.max_prompt_tokens:
            raise too_long(len(prompt_ids), self.limits, param)
        context = self.source.max_context
        room = context - len(prompt_ids)
        default = self.limits.max_tokens if chat else self.limits.default_max_tokens
        max_tokens = request.max_tokens or min(default, room)
        if max_tokens > room or room < 1:
            raise RequestError(
                f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({max_tokens}) exceed "
                f"the model's context of {context}",
                param="max_tokens" if request.max_tokens and room >= 1 else param,
                code="context_length_exceeded",
            )
        return max_tokens


async def _first_piece(pieces: AsyncIterator[Piece]) -> Piece:
    """The first piece, so that a source that cannot start (no plan, overloaded, a bad request)
    is an HTTP status rather than an error inside a stream already answered 200."""
    try:
        return await anext(pieces)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await pieces.aclose()
        if isinstance(exc, Exception):
            raise _refusal(exc) from exc
        raise


def _refusal(exc: Exception) -> RequestError:
    """What a client is told when generation fails; unexpected errors are logged, not shown."""
    if isinstance(exc, TimeoutError):
        return RequestError(
            "the model sent no token in time (GatewayLimits.idle_timeout_s)",
            status=504,
            kind="server_error",
            code="timeout",
        )
    if isinstance(exc, OverloadedError):
        return RequestError(str(exc), status=429, kind="rate_limit_error", code="overloaded")
    if isinstance(exc, ServeError | PeerError):
        return RequestError(
            f"the model could not answer: {exc}",
            status=503,
            kind="server_error",
            code="unavailable",
        )
    if isinstance(exc, ConfigError):
        return RequestError(str(exc))
    logger.exception("generation failed")
    return RequestError("internal error while generating", status=500, kind="server_error")


async def _whole(
    job: _Job, first: Piece, pieces: AsyncIterator[Piece], request: Request
) -> Response:
    texts, last = [first.text], first
    try:
        while last.finish_reason is None:
            if await request.is_disconnected():
                logger.info("%s: the client left before the answer was complete", job.reply.id)
                return Response(status_code=499)
            last = await anext(pieces)
            texts.append(last.text)
    except Exception as exc:
        return _error(_refusal(exc))
    finally:
        with anyio.CancelScope(shield=True):
            await pieces.aclose()
    n_prompt = len(job.prompt_ids)
    body = job.reply.whole("".join(texts), last.finish_reason, n_prompt, last.completion_tokens)
    return JSONResponse(body)


async def _events(job: _Job, first: Piece, pieces: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
    """The SSE body: chunks of text, the finish reason, usage if asked, then [DONE]. An error
    after the first chunk can only be told inside the stream: an error event, then [DONE]."""
    reply, last = job.reply, first
    try:
        if reply.chat:
            yield event(reply.chunk("", role=True))
        while True:
            if last.text:
                yield event(reply.chunk(last.text))
            if last.finish_reason is not None:
                break
            last = await anext(pieces)
        yield event(reply.chunk(None, last.finish_reason))
        if job.request.include_usage:
            yield event(reply.usage_chunk(len(job.prompt_ids), last.completion_tokens))
    except Exception as exc:
        yield event(_refusal(exc).body())
    finally:
        with anyio.CancelScope(shield=True):
            await pieces.aclose()
    yield DONE


class _Stream(StreamingResponse):
    """A streamed answer that frees its slot and closes its session however it ends: the
    body's own ``finally`` does not run if the client left before the body was started, and
    then the pieces, already started for their first one, are closed here."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        pieces: AsyncIterator[Piece],
        *,
        release: Callable[[], None],
    ) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._pieces = pieces
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._pieces.aclose()
            self._release()


def _error(exc: RequestError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)
