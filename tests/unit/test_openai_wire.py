"""Request validation: OpenAI bodies in, GenerationRequest or RequestError (with param) out."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.serve.chat import ChatMessage
from fusionllm.node.serve.gateway_config import GatewayLimits
from fusionllm.node.serve.openai_wire import (
    GenerationRequest,
    RequestError,
    parse_chat,
    parse_completion,
)

LIMITS = GatewayLimits(max_tokens=64, max_messages=3, max_prompt_tokens=8)
CHAT = [{"role": "user", "content": "Hi"}]


def test_a_full_completion_request():
    body = {
        "model": "m",
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 3,
        "stop": ["\n", "END"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "ignored",  # unknown fields are ignored
    }
    assert parse_completion(body, LIMITS) == GenerationRequest(
        model="m",
        prompt_text="Hello",
        max_tokens=5,
        temperature=0.0,
        top_p=0.5,
        seed=3,
        stop=("\n", "END"),
        stream=True,
        include_usage=True,
    )


def test_defaults_and_prompt_forms():
    assert parse_completion({"model": "m", "prompt": "x"}, LIMITS) == GenerationRequest(
        model="m", prompt_text="x"
    )
    assert parse_completion({"model": "m", "prompt": [1, 2]}, LIMITS).prompt_ids == (1, 2)
    assert parse_completion({"model": "m", "prompt": ["one"]}, LIMITS).prompt_text == "one"
    assert parse_completion({"model": "m", "prompt": "x", "stop": "S"}, LIMITS).stop == ("S",)
    assert parse_completion({"model": "m", "prompt": "x", "n": 1, "echo": False}, LIMITS).model


def test_chat_messages_text_parts_and_max_completion_tokens():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "max_completion_tokens": 7,
    }
    request = parse_chat(body, LIMITS)
    assert request.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="ab"),
    )
    assert request.max_tokens == 7


@pytest.mark.parametrize(
    ("change", "param", "match"),
    [
        ({"model": None}, "model", "model must be a non-empty string"),
        ({"prompt": ""}, "prompt", "prompt is empty"),
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({"prompt": [1, True]}, "prompt", "list of token ids"),
        ({"prompt": [-1]}, "prompt", r"token ids must be in \[0, 2\*\*31\)"),
        ({"prompt": list(range(9))}, "prompt", "9 tokens; at most 8"),
        ({"max_tokens": 0}, "max_tokens", r"in \[1, 64\], got 0"),
        ({"max_tokens": 65}, "max_tokens", r"in \[1, 64\], got 65"),
        ({"max_tokens": 2.0}, "max_tokens", "must be an integer"),
        ({"temperature": 2.5}, "temperature", r"number in \[0, 2\]"),
        ({"temperature": float("nan")}, "temperature", "must be a number"),
        ({"temperature": "1"}, "temperature", "must be a number"),
        ({"top_p": 0}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p", "top_p must be a number"),
        ({"seed": -1}, "seed", "seed must be an integer"),
        ({"seed": 2**63}, "seed", "seed must be an integer"),
        ({"stop": ["a"] * 5}, "stop", "at most 4 stop strings"),
        ({"stop": ""}, "stop", "non-empty string"),
        ({"stop": [1]}, "stop", "non-empty string"),
        ({"stop": "x" * 257}, "stop", "256 characters"),
        ({"stream": "yes"}, "stream", "stream must be true or false"),
        ({"prompt": "a\ud800"}, "prompt", "prompt is not valid Unicode: surrogates not allowed"),
        ({"stop": ["\udfff"]}, "stop", "stop is not valid Unicode"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "with stream only"),
        ({"n": 2}, "n", "n=2 is not supported"),
        ({"n": True}, "n", "n=True is not supported"),
        ({"logprobs": 0}, "logprobs", "logprobs=0 is not supported"),
        ({"echo": True}, "echo", "echo=True is not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ],
)
def test_completion_refusals_name_the_field(change, param, match):
    body = {"model": "m", "prompt": "x"} | change
    with pytest.raises(RequestError, match=match) as caught:
        parse_completion(body, LIMITS)
    assert (caught.value.status, caught.value.param) == (400, param)
    error = caught.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "param", "match"),
    [
        (None, "messages", "non-empty list"),
        ([], "messages", "non-empty list"),
        (CHAT * 4, "messages", "4 messages; at most 3"),
        (["hi"], "messages[0]", "must be an object"),
        ([{"role": "tool", "content": "x"}], "messages[0].role", "role must be one of"),
        ([{"role": "user"}], "messages[0].content", "string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            "messages[0].content",
            "only text",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages[0].content",
            "needs a string",
        ),
    ],
)
def test_chat_refusals_name_the_field(messages, param, match):
    with pytest.raises(RequestError, match=match) as caught:
        parse_chat({"model": "m", "messages": messages}, LIMITS)
    assert caught.value.param == param


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_chat([CHAT], LIMITS)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_concurrent", 0, "max_concurrent must be an int >= 1"),
        ("max_body_bytes", 1.5, "max_body_bytes must be an int >= 1"),
        ("default_max_tokens", 2000, r"default_max_tokens \(2000\) exceeds max_tokens"),
        ("idle_timeout_s", 0, r"idle_timeout_s must be in \(0, 1e6\) s, got 0"),
        ("idle_timeout_s", float("nan"), "idle_timeout_s must be in"),
    ],
)
def test_limits_are_validated(field, value, match):
    with pytest.raises(ConfigError, match=match):
        GatewayLimits(**{field: value})
