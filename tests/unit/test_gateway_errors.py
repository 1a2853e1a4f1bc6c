"""How the gateway refuses: status codes and OpenAI's error shape, from a fake source's errors.

The app runs in-process under httpx's ASGI transport (no server): what is tested here is the
mapping of errors to answers; tests/integration/test_gateway.py runs the real server.
"""

import json
from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.lowlevel
import httpx
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.serve.api import (
    BadLogitsError,
    NoServingPlanError,
    OverloadedError,
    SamplingParams,
    SessionLostError,
)
from fusionllm.node.serve.gateway import gateway_app
from fusionllm.node.serve.gateway_config import GatewayLimits
from fusionllm.node.serve.text import TextCodec


class FailingSource:
    """Yields ``good`` ids, then raises ``error`` (a fake of the TokenSource protocol)."""

    model_name, vocab_size, max_context = "fake", 256, 64

    def __init__(self, error: Exception, good: bytes = b"") -> None:
        self.error, self.good = error, good

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        for token in self.good:
            yield token
        raise self.error

    async def aclose(self) -> None:
        return None


class HangingSource(FailingSource):
    """Yields ``good`` ids, then waits for ever (a swarm that stopped answering)."""

    def __init__(self, good: bytes) -> None:
        super().__init__(RuntimeError("unused"), good)
        self.closed = False

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        try:
            for token in self.good:
                yield token
            await anyio.sleep_forever()
        finally:
            self.closed = True


def _post(source, path: str, body: dict | bytes, limits: GatewayLimits | None = None):
    app = gateway_app(source, TextCodec.byte_level(), limits=limits)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            if isinstance(body, bytes):
                return await client.post(path, content=body)
            return await client.post(path, json=body)

    return anyio.run(main)


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize(
    ("error", "status", "code", "match"),
    [
        (NoServingPlanError("no plan for 'fake'"), 503, "unavailable", "no plan for 'fake'"),
        (SessionLostError("route broke"), 503, "unavailable", "route broke"),
        (BadLogitsError("logits are not all finite"), 503, "unavailable", "not all finite"),
        (OverloadedError("caches full"), 429, "overloaded", "caches full"),
        (RuntimeError("secret detail"), 500, None, "internal error while generating"),
    ],
)
def test_a_source_that_cannot_start_gets_a_status(error, status, code, match):
    response = _post(FailingSource(error), "/v1/completions", COMPLETION)
    assert response.status_code == status
    body = _error(response)
    assert body["code"] == code
    assert match in body["message"]
    assert "secret" not in body["message"]


def test_an_error_mid_stream_is_an_error_event_then_done():
    source = FailingSource(SessionLostError("a stage left"), good=b"ok")
    body = COMPLETION | {"stream": True}
    response = _post(source, "/v1/completions", body)
    assert response.status_code == 200  # the first text went out before the error
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["o", "k"]
    assert "a stage left" in json.loads(events[2])["error"]["message"]
    assert events[3:] == ["[DONE]"]


def test_an_error_after_some_text_of_a_whole_answer_is_a_status():
    response = _post(
        FailingSource(SessionLostError("gone"), good=b"ok"), "/v1/completions", COMPLETION
    )
    assert response.status_code == 503
    assert "gone" in _error(response)["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_source_that_hangs_is_cut_after_the_idle_timeout_and_closed(stream):
    source = HangingSource(b"ok")
    limits = GatewayLimits(idle_timeout_s=0.3)
    response = _post(source, "/v1/completions", COMPLETION | {"stream": stream}, limits)
    assert source.closed
    if stream:
        assert "sent no token in time" in response.text
        assert response.text.endswith("data: [DONE]\n\n")
    else:
        assert (response.status_code, _error(response)["code"]) == (504, "timeout")


def test_bodies_over_the_limit_are_refused_with_413():
    limits = GatewayLimits(max_body_bytes=100)
    big = COMPLETION | {"prompt": "x" * 200}
    response = _post(FailingSource(ConfigError("unused")), "/v1/completions", big, limits)
    assert (response.status_code, _error(response)["code"]) == (413, "body_too_large")
    assert "over 100 bytes" in _error(response)["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [({"prompt": "x" * 70}, "prompt"), ({"prompt": "x" * 60, "max_tokens": 5}, "max_tokens")],
)
def test_what_the_context_cannot_hold_is_refused_before_generating(change, param):
    source = FailingSource(RuntimeError("never"))
    response = _post(source, "/v1/completions", COMPLETION | change)
    assert response.status_code == 400
    error = _error(response)
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert "exceed the model's context of 64" in error["message"]


def test_prompt_ids_outside_the_vocabulary_are_refused():
    source = FailingSource(RuntimeError("never"))
    response = _post(source, "/v1/completions", COMPLETION | {"prompt": [1, 256]})
    assert response.status_code == 400
    assert _error(response)["param"] == "prompt"
    assert r"prompt ids must be ints in [0, 256)" in _error(response)["message"]


def test_a_lone_surrogate_in_the_json_is_a_400_not_a_crash():
    body = b'{"model": "fake", "messages": [{"role": "user", "content": "\\ud800"}]}'
    response = _post(FailingSource(RuntimeError("never")), "/v1/chat/completions", body)
    assert response.status_code == 400
    assert _error(response)["param"] == "messages[0].content"


def test_a_bug_is_a_500_in_the_error_shape_without_its_detail():
    def broken(text: str) -> list[int]:
        raise KeyError("secret detail")

    codec = TextCodec(encode=broken, decode=lambda ids: "", vocab_size=256)
    app = gateway_app(FailingSource(RuntimeError("never")), codec)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            return await client.post("/v1/completions", json=COMPLETION)

    response = anyio.run(main)
    assert response.status_code == 500
    assert _error(response)["message"] == "internal error"


def test_unknown_routes_and_methods_have_the_error_shape():
    source = FailingSource(RuntimeError("never"))
    app = gateway_app(source, TextCodec.byte_level())

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://g"
        ) as c:
            return await c.get("/v1/engines"), await c.get("/v1/completions")

    missing, wrong_method = anyio.run(main)
    assert (missing.status_code, _error(missing)["type"]) == (404, "not_found_error")
    assert wrong_method.status_code == 405
    assert _error(wrong_method)["type"] == "invalid_request_error"


def test_a_max_tokens_limit_over_the_contracts_is_refused_at_start():
    with pytest.raises(ConfigError, match="max_tokens limit 5000 is over 4096"):
        gateway_app(
            FailingSource(RuntimeError()),
            TextCodec.byte_level(),
            limits=GatewayLimits(max_tokens=5000),
        )


def test_a_tokenizer_larger_than_the_model_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"tokenizer's vocabulary \(300\) is larger"):
        gateway_app(FailingSource(RuntimeError()), TextCodec.byte_level(vocab_size=300))


def _gone_after_the_body(app, stream: bool) -> list[dict]:
    """Calls ``app`` as uvicorn would for a client that sends its request, then disconnects."""
    body = json.dumps(COMPLETION | {"max_tokens": 60, "stream": stream}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # uvicorn's
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        await anyio.lowlevel.checkpoint()  # where the disconnect cancels the response's task

    async def main() -> None:
        await app(scope, receive, send)

    anyio.run(main)
    return sent


def _in_flight(app) -> int:
    async def main() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
            return (await client.get("/health")).json()["in_flight"]

    return anyio.run(main)


def test_a_client_gone_before_the_stream_starts_frees_its_slot_and_session():
    source = HangingSource(b"ok")  # the first piece comes, then nothing: only closing ends it
    app = gateway_app(source, TextCodec.byte_level())
    sent = _gone_after_the_body(app, stream=True)
    assert source.closed  # on the request's loop: not left to the garbage collector
    assert _in_flight(app) == 0
    assert not any(m.get("body") for m in sent if m["type"] == "http.response.body")


class SlowSource(HangingSource):
    """Yields an id every 10 ms up to max_new_tokens, counting them."""

    def __init__(self) -> None:
        super().__init__(b"")
        self.yielded = 0

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        try:
            for _ in range(params.max_new_tokens):
                await anyio.sleep(0.01)
                self.yielded += 1
                yield ord("a")
        finally:
            self.closed = True


def test_a_client_gone_during_a_whole_answer_stops_its_generation():
    source = SlowSource()
    app = gateway_app(source, TextCodec.byte_level())
    sent = _gone_after_the_body(app, stream=False)
    assert source.closed
    assert source.yielded < 60  # stopped when the disconnect was seen, not at max_tokens
    assert _in_flight(app) == 0
    assert sent[0]["status"] == 499
