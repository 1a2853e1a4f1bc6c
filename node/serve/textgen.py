"""Token ids from a ``TokenSource`` into text pieces, with stop ids and stop strings applied.

``generate_text`` is what both the streamed and the whole answers of the gateway are made of,
so a greedy request gives the same text either way. The source's stream is closed when the
pieces end, early or not (a stop string, a client gone): closing it ends the session and frees
its caches.
"""

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import anyio

from fusionllm.node.serve.api import SamplingParams, TokenSource
from fusionllm.node.serve.text import StreamDecoder


@dataclass(frozen=True)
class Piece:
    """New text; the last piece of a generation has a finish reason ("stop" or "length")."""

    text: str
    completion_tokens: int  # ids the source produced so far (a stop id counts)
    finish_reason: str | None = None


class StopMatcher:
    """Cuts text at the first stop string, holding back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found: nothing after it counts)."""
        self._held += text
        cut = min((i for i in (self._held.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._held = self._held[:cut], ""
            return out, True
        keep = max((_overlap(self._held, s) for s in self._stops), default=0)
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(out) :]
        return out, False

    def finish(self) -> str:
        out, self._held = self._held, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that ``stop`` starts with (shorter than stop)."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0


async def generate_text(
    source: TokenSource,
    decoder: StreamDecoder,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stops: Sequence[str] = (),
) -> AsyncIterator[Piece]:
    """Text pieces of the continuation; the last has the finish reason and no text after it.

    A stop id ends the text without being decoded; a stop string ends it before the string.
    """
    matcher = StopMatcher(stops)
    count = 0
    reason = "length"  # the source stops on its own only at max_new_tokens or a stop id
    stream = source.stream(prompt_ids, params)
    try:
        async for token in stream:
            count += 1
            if token in params.stop_ids:
                reason = "stop"
                break
            text, hit = matcher.push(decoder.push(token))
            if hit:
                yield Piece(text, count, "stop")
                return
            if text:
                yield Piece(text, count)
    finally:
        # Shielded: a cancelled request (its client gone) must still close the session, and
        # in a cancelled scope the close would be cancelled again at its first await.
        with anyio.CancelScope(shield=True):
            await stream.aclose()
    text, hit = matcher.push(decoder.finish())
    yield Piece(text + ("" if hit else matcher.finish()), count, "stop" if hit else reason)


async def with_idle_timeout(pieces: AsyncIterator[Piece], idle_s: float) -> AsyncIterator[Piece]:
    """``pieces``, failing with TimeoutError when the next one takes over ``idle_s``: a source
    that hangs (a swarm that stopped answering) cannot hold a request open for ever."""
    try:
        while True:
            with anyio.fail_after(idle_s):
                try:
                    piece = await anext(pieces)
                except StopAsyncIteration:
                    return
            yield piece  # outside the timeout's scope: the consumer's time is not counted
    finally:
        with anyio.CancelScope(shield=True):
            await pieces.aclose()
