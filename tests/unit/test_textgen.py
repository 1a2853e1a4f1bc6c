"""Ids into text pieces: stop ids, stop strings cut across pieces, the source always closed."""

from collections.abc import AsyncIterator, Sequence

import anyio
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.node.serve.api import SamplingParams
from fusionllm.node.serve.text import TextCodec
from fusionllm.node.serve.textgen import Piece, StopMatcher, generate_text


class ScriptedSource:
    """Yields fixed ids (a fake of the TokenSource protocol); records whether it was closed."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self.closed = False

    model_name, vocab_size, max_context = "scripted", 256, 1024

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        try:
            for token in self.ids[: params.max_new_tokens]:
                yield token
                if token in params.stop_ids:
                    return
        finally:
            self.closed = True

    async def aclose(self) -> None:
        return None


def _run(source, params, stops=(), *, take=None) -> list[Piece]:
    async def main() -> list[Piece]:
        pieces = generate_text(source, TextCodec.byte_level().stream_decoder(), [1], params, stops)
        out = []
        async for piece in pieces:
            out.append(piece)
            if take is not None and len(out) == take:
                await pieces.aclose()
                break
        return out

    return anyio.run(main)


def _text(pieces: list[Piece]) -> str:
    return "".join(p.text for p in pieces)


def test_length_ends_with_all_the_text_and_the_count():
    source = ScriptedSource(b"hello world")
    pieces = _run(source, SamplingParams(max_new_tokens=5))
    assert (_text(pieces), pieces[-1].finish_reason, pieces[-1].completion_tokens) == (
        "hello",
        "length",
        5,
    )
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert source.closed


def test_a_stop_id_ends_the_text_without_being_decoded():
    source = ScriptedSource(b"abc\x00def")
    pieces = _run(source, SamplingParams(max_new_tokens=50, stop_ids=(0,)))
    assert (_text(pieces), pieces[-1].finish_reason, pieces[-1].completion_tokens) == (
        "abc",
        "stop",
        4,
    )


def test_a_stop_string_cuts_before_it_and_closes_the_source_early():
    source = ScriptedSource(b"one two STOP three" + b"x" * 100)
    pieces = _run(source, SamplingParams(max_new_tokens=100), stops=("STOP",))
    assert (_text(pieces), pieces[-1].finish_reason) == ("one two ", "stop")
    assert pieces[-1].completion_tokens == len("one two STOP")
    assert source.closed


def test_a_multibyte_character_held_at_a_stop_string_is_kept():
    pieces = _run(ScriptedSource("a日b".encode()), SamplingParams(max_new_tokens=9), stops=("b",))
    assert _text(pieces) == "a日"


def test_a_consumer_that_stops_early_closes_the_source():
    source = ScriptedSource(b"abcdefgh")
    pieces = _run(source, SamplingParams(max_new_tokens=8), take=2)
    assert _text(pieces) == "ab"
    assert source.closed


@given(
    st.text(alphabet="abc", max_size=30),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.integers(1, 5), max_size=30),
)
def test_stop_matcher_equals_cutting_the_whole_text(text, stops, cuts):
    matcher, out, hit, at = StopMatcher(stops), [], False, 0
    for size in [*cuts, len(text)]:
        piece, hit = matcher.push(text[at : at + size])
        out.append(piece)
        at += size
        if hit:
            break
    if not hit:
        out.append(matcher.finish())
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    assert "".join(out) == text[:first]
    assert hit == (first < len(text))


def test_stop_matcher_holds_only_what_may_begin_a_stop():
    matcher = StopMatcher(["ab"])
    assert matcher.push("xxa") == ("xx", False)  # "a" may begin "ab"
    assert matcher.push("c") == ("ac", False)
    assert matcher.push("aa") == ("a", False)
    assert matcher.push("b") == ("", True)
