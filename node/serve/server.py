"""A serving node's stage: the span of blocks its plan gives it, and the sessions on it.

``StageServer.follow(route)`` (re)loads this node's span when an adopted plan moves it (only
the span's tensors are read from the folder); ``handle`` serves one stream, one session:
``info``, ``open`` (admitted against ``SessionBook``), then ``step`` after ``step``. Compute
runs in a worker thread, one step at a time per node, so the host's trio loop keeps serving
other streams. A session keeps the span it opened on even if the node moves meanwhile (its
client finds out from the next plan).
"""

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import trio

from fusionllm.common.errors import FrameError
from fusionllm.common.logs import get_logger
from fusionllm.compression.codecs import Float16Codec
from fusionllm.compression.frame import decode_frame, pack_tensor, parse_frame
from fusionllm.compression.limits import FrameLimits
from fusionllm.dag.models.decoding import CachedSpan, load_span
from fusionllm.dag.models.kv_cache import KVCache
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, close_quietly
from fusionllm.node.serve.api import OverloadedError
from fusionllm.node.serve.layout import RouteStage
from fusionllm.node.serve.sessions import ServeLimits, SessionBook
from fusionllm.node.serve.wire import ServeWireError, error, field, receive, send

logger = get_logger(__name__)


@dataclass
class _Session:
    span: CachedSpan
    cache: KVCache
    fp16: bool


class StageServer:
    def __init__(self, folder: str | Path, *, limits: ServeLimits, name: str) -> None:
        self.folder = Path(folder)
        self.limits = limits
        self.name = name
        self.book = SessionBook(limits)
        self._span: CachedSpan | None = None
        self._swap = threading.Lock()
        self._compute = trio.CapacityLimiter(1)

    @property
    def span(self) -> CachedSpan | None:
        return self._span

    def follow(self, stage: RouteStage | None) -> None:
        """Hold ``stage``'s span (None: serve nothing); called from a plan watcher thread."""
        current = self._span
        if stage is None:
            self._span = None
            return
        if current is not None and (current.span.start, current.span.stop) == (
            stage.start,
            stage.stop,
        ):
            return
        with self._swap:
            self._span = load_span(self.folder, stage.start, stage.stop)
        logger.info("serving blocks [%d, %d) as stage %d", stage.start, stage.stop, stage.index)

    def info(self) -> dict[str, Any]:
        span = self._span
        if span is None:
            return error("unavailable", "this node serves no stage now")
        config = span.config
        return {
            "ok": True,
            "model": self.name,
            "layers": config.num_hidden_layers,
            "span": [span.span.start, span.span.stop],
            "vocab": config.vocab_size,
            "context": min(config.block_size, self.limits.max_len),
            "hidden": _width(config),
        }

    async def handle(self, stream) -> None:
        session: _Session | None = None
        try:
            while True:
                message = await receive(stream, stall_timeout_s=self.limits.idle_s)
                reply, session = await self._answer(message, session)
                await send(stream, reply)
                if not reply["ok"]:
                    break
        except (ServeWireError, FrameError, DeadlineError, *NETWORK_ERRORS) as exc:
            logger.debug("serving stream ended: %s", exc, exc_info=True)
        except Exception:  # one bad session never takes the node's host down
            logger.warning("a serving session failed", exc_info=True)
        finally:
            if session is not None:
                self.book.release(session.cache.nbytes)
            await close_quietly(stream)

    async def _answer(self, message: dict, session: _Session | None):
        op = message.get("op")
        try:
            if op == "info":
                return self.info(), session
            if op == "open" and session is None:
                session = self._open(message)
                return self.info() | {"max_len": session.cache.shape.max_len}, session
            if op == "step" and session is not None:
                return await self._step(session, message), session
            return error("bad", f"op {op!r} is not allowed here"), session
        except OverloadedError as exc:
            return error("overloaded", str(exc)), session
        except (ServeWireError, FrameError) as exc:
            return error("bad", str(exc)), session

    def _open(self, message: dict) -> _Session:
        span = self._span
        if span is None:
            raise ServeWireError("this node serves no stage now")
        context = min(span.config.block_size, self.limits.max_len)
        max_len = field(message, "max_len", int, low=1, high=context)
        wanted = message.get("span")
        if wanted != [span.span.start, span.span.stop]:
            raise ServeWireError(f"this node serves {[span.span.start, span.span.stop]}")
        shape = span.cache_shape(max_len)
        self.book.admit(shape.nbytes(torch.float32))
        try:
            cache = span.new_cache(max_len)
        except BaseException:
            self.book.release(shape.nbytes(torch.float32))
            raise
        return _Session(span=span, cache=cache, fp16=bool(message.get("fp16", False)))

    async def _step(self, session: _Session, message: dict) -> dict[str, Any]:
        cache = session.cache
        field(message, "pos", int, low=cache.length, high=cache.length)
        x = self._input(session, field(message, "t", bytes))
        out = await trio.to_thread.run_sync(session.span.forward, x, cache, limiter=self._compute)
        if session.span.span.heads:
            return {"ok": True, "t": pack_tensor(out[0, -1])}  # (V,) logits stay fp32
        return {"ok": True, "t": pack_tensor(out, Float16Codec() if session.fp16 else None)}

    def _input(self, session: _Session, frame: bytes) -> torch.Tensor:
        """The step's ids (1, T) or stream (1, T, C): checked before it is allocated."""
        span, room = session.span, session.cache.shape.max_len - session.cache.length
        config = span.config
        if span.span.embeds:
            parsed = parse_frame(frame, limits=_limits(room, 2), expect_dtype=torch.int64)
            if len(parsed.target.shape) != 2 or parsed.target.shape[0] != 1:
                raise ServeWireError(f"ids must be (1, T), got {parsed.target.shape}")
            ids = decode_frame(parsed)  # (1, T)
            if ids.numel() == 0 or not bool(((ids >= 0) & (ids < config.vocab_size)).all()):
                raise ServeWireError(f"ids must be in [0, {config.vocab_size})")
            return ids
        width = _width(config)
        parsed = parse_frame(frame, limits=_limits(room * width, 3), expect_dtype=torch.float32)
        shape = tuple(parsed.target.shape)
        if len(shape) != 3 or shape[0] != 1 or shape[2] != width or shape[1] < 1:
            raise ServeWireError(f"the stream must be (1, T, {width}), got {shape}")
        return decode_frame(parsed)  # (1, T, C), finite (the frame limits refuse NaN/inf)


def _limits(elements: int, rank: int) -> FrameLimits:
    return FrameLimits(max_elements=max(elements, 1), max_rank=rank, max_frame_bytes=64 << 20)


def _width(config) -> int:
    return getattr(config, "n_embd", None) or config.hidden_size
