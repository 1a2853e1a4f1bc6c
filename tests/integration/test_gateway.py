"""The OpenAI-compatible gateway as a client sees it: a real uvicorn server in its own process,
real HTTP (httpx, and OpenAI's own client), a real model (a random GPT-2 and its BPE tokenizer,
written here) behind ``tests/support/recompute_source.py``.

One module-scoped server (2 requests at once, 30 ms a token as a swarm's latency) serves all
tests; greedy answers are checked against the model run in this process.
"""

import contextlib
import json
import selectors
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from fusionllm.dag.models.pretrained import from_pretrained
from fusionllm.node.serve.text import TextCodec
from tests.support.recompute_source import generate_ids
from tests.support.text_models import write_text_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "test-model"
MAX_CONCURRENT = 2
START_S = 120  # importing torch and loading the model, on a busy 2-core machine
PROMPT = "The swarm serves"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße! 🚀"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_text_model(tmp_path_factory.mktemp("gateway") / "model", block_size=160)


@pytest.fixture(scope="module")
def url(model_dir):
    command = [sys.executable, "-m", "tests.support.gateway_main", str(model_dir)]
    command += ["--max-concurrent", str(MAX_CONCURRENT), "--token-delay", "0.03"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        yield _first_line(proc)["url"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def _first_line(proc: subprocess.Popen) -> dict:
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=START_S):
            raise AssertionError(f"the gateway did not start within {START_S} s")
    line = proc.stdout.readline()
    assert line, f"the gateway exited with {proc.wait(timeout=20)} before it listened"
    return json.loads(line)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The model and its codec in this process: what greedy answers must equal."""
    return from_pretrained(model_dir), TextCodec.from_model_folder(model_dir)


def _expected(reference, prompt_ids: list[int], max_tokens: int) -> tuple[str, str, int]:
    """(text, finish reason, completion tokens) of greedy generation, stopping at eos."""
    model, codec = reference
    ids = generate_ids(model, prompt_ids, max_tokens)
    for n, token in enumerate(ids, start=1):
        if token in codec.eos_ids:
            return codec.decode(ids[: n - 1]), "stop", n
    return codec.decode(ids), "length", max_tokens


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_models_lists_the_served_model(url):
    body = httpx.get(url + "/v1/models", timeout=30).json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [(MODEL, "model")]


def test_a_greedy_completion_equals_the_model_in_this_process(url, reference):
    answer = _post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    prompt_ids = reference[1].encode(PROMPT)
    text, reason, count = _expected(reference, prompt_ids, 12)
    assert text  # an empty answer would make the comparison vacuous
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, reason)
    assert body["object"] == "text_completion"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": count,
        "total_tokens": len(prompt_ids) + count,
    }
    # The same prompt as ids gives the same answer.
    by_ids = _post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": prompt_ids, "max_tokens": 12, "temperature": 0},
    )
    assert by_ids.json()["choices"][0]["text"] == text


def _sse(response: httpx.Response) -> list[str]:
    """The data of each server-sent event, in order."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


def test_a_streamed_chat_equals_the_whole_answer(url):
    request = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    whole = _post(url, "/v1/chat/completions", request).json()
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"]
    stream = request | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    texts = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert len([t for t in texts if t]) > 1  # it did stream, in pieces
    assert "".join(texts) == message["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert (chunks[-1]["choices"], chunks[-1]["usage"]) == ([], whole["usage"])


def test_stop_strings_and_seeded_sampling(url, reference):
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12}
    text, _, _ = _expected(reference, reference[1].encode(PROMPT), 12)
    stop = text[3:5]
    cut = _post(url, "/v1/completions", base | {"temperature": 0, "stop": [stop]}).json()[
        "choices"
    ][0]
    assert (cut["text"], cut["finish_reason"]) == (text[: text.find(stop)], "stop")

    def sampled(seed: int) -> str:
        body = base | {"temperature": 1.0, "top_p": 0.9, "seed": seed}
        return _post(url, "/v1/completions", body).json()["choices"][0]["text"]

    first = sampled(7)
    assert sampled(7) == first  # a seed gives the same draw again
    assert {sampled(seed) for seed in (1, 2, 3)} != {text}  # and sampling is not greedy


def test_errors_have_openai_shape_and_status(url):
    cases = [
        ({"model": "other", "prompt": "x"}, 404, "model_not_found"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
        ({"model": MODEL, "prompt": "x", "n": 3}, 400, "unsupported"),
        ({"model": MODEL, "prompt": "x" * (2 << 20)}, 413, "body_too_large"),
        ({"model": MODEL, "prompt": "x " * 400}, 400, "context_length_exceeded"),
    ]
    for body, status, code in cases:
        answer = _post(url, "/v1/completions", body)
        assert answer.status_code == status, (body.keys(), answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == code
    garbled = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert (garbled.status_code, garbled.json()["error"]["type"]) == (400, "invalid_request_error")
    assert httpx.get(url + "/v1/nothing", timeout=30).json()["error"]["type"] == "not_found_error"


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_concurrency_is_bounded_and_a_client_that_leaves_closes_its_session(url):
    before = httpx.get(url + "/test/sessions", timeout=30).json()
    long = {"model": MODEL, "prompt": "x", "max_tokens": 120, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as leave:
        clients = [leave.enter_context(httpx.Client(timeout=60)) for _ in range(MAX_CONCURRENT)]
        reading = []  # held: httpx closes a response whose line iterator is dropped
        for client in clients:
            response = leave.enter_context(
                client.stream("POST", url + "/v1/completions", json=long)
            )
            assert response.status_code == 200
            reading.append(response.iter_lines())
            next(reading[-1])  # generating: 120 tokens take >= 3.6 s at 30 ms each
        refused = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert httpx.get(url + "/health", timeout=30).json()["in_flight"] == MAX_CONCURRENT
    # leaving the stack closed the clients, dropping their connections mid-stream

    def all_closed():
        sessions = httpx.get(url + "/test/sessions", timeout=30).json()
        new = sessions["lengths"][len(before["lengths"]) :]
        return (
            new
            if sessions["opened"]
            == before["opened"] + MAX_CONCURRENT
            == len(sessions["lengths"]) - len(before["lengths"]) + before["opened"]
            else None
        )

    lengths = _wait_for(all_closed, 60, "both sessions to close")
    assert all(n < 120 for n in lengths), lengths  # closed by the disconnect, not by finishing
    assert httpx.get(url + "/health", timeout=30).json()["in_flight"] == 0
    again = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert again.status_code == 200


def test_openai_python_client(url, reference):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        assert [m.id for m in client.models.list()] == [MODEL]
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
        )
        assert (
            completion.choices[0].text == _expected(reference, reference[1].encode(PROMPT), 12)[0]
        )
        whole = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=16, temperature=0
        )
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True
        )
        deltas = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        assert "".join(deltas) == whole.choices[0].message.content
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client.completions.create(model="other", prompt="x")
        with pytest.raises(openai.BadRequestError, match="temperature must be a number"):
            client.completions.create(model=MODEL, prompt="x", temperature=3)
    finally:
        client.close()
