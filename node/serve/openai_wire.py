"""OpenAI's request bodies in, checked: ``parse_completion`` and ``parse_chat`` (pure functions).

A body is untrusted JSON: every field we use is checked for type and range against
``GatewayLimits``; fields we do not implement are refused when they ask for something other
than their default (``n`` > 1, ``logprobs``, penalties, ``echo``, tools), so a client never gets
an answer to a question it did not ask. Unknown fields are ignored, as OpenAI-compatible
servers commonly do. A refusal is a ``RequestError`` carrying OpenAI's error fields.
"""

import math
from dataclasses import dataclass
from typing import Any

from fusionllm.common.errors import FusionError
from fusionllm.node.serve.chat import ROLES, ChatMessage
from fusionllm.node.serve.gateway_config import GatewayLimits

MAX_TEMPERATURE = 2.0  # OpenAI's range; api.SamplingParams allows more
# Fields we do not implement, each with the one value (besides null) that asks nothing of it.
_UNSUPPORTED_UNLESS = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": False,
    "top_logprobs": 0,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "suffix": "",
    "tools": [],
    "functions": [],
    "response_format": {"type": "text"},
}


class RequestError(FusionError):
    """A request we refuse, in OpenAI's terms: HTTP status, message, type, param and code."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message,
            param,
            status,
            kind,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str, *, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """What a completion or a chat request asks for, checked; the prompt is text or ids."""

    model: str
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage


def parse_completion(body: Any, limits: GatewayLimits) -> GenerationRequest:
    """A /v1/completions body: one prompt, a string or a list of token ids."""
    fields = _common(body, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        return GenerationRequest(prompt_text=_unicode(prompt, "prompt"), **fields)
    if isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt):
        if len(prompt) > limits.max_prompt_tokens:
            raise too_long(len(prompt), limits, "prompt")
        if any(not 0 <= i < 2**31 for i in prompt):
            raise RequestError("prompt token ids must be in [0, 2**31)", param="prompt")
        return GenerationRequest(prompt_ids=tuple(prompt), **fields)
    raise RequestError(
        "prompt must be a non-empty string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def parse_chat(body: Any, limits: GatewayLimits) -> GenerationRequest:
    """A /v1/chat/completions body: turns with text content (a string or text parts)."""
    fields = _common(body, limits)
    if "max_completion_tokens" in body and body.get("max_tokens") is None:
        fields["max_tokens"] = _max_tokens(body, "max_completion_tokens", limits)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", param="messages")
    if len(raw) > limits.max_messages:
        raise RequestError(
            f"{len(raw)} messages; at most {limits.max_messages} are accepted", param="messages"
        )
    messages = tuple(_message(item, i) for i, item in enumerate(raw))
    return GenerationRequest(messages=messages, **fields)


def _common(body: Any, limits: GatewayLimits) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _refuse_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string (see GET /v1/models)", param="model")
    return {
        "model": model,
        "max_tokens": _max_tokens(body, "max_tokens", limits),
        "temperature": _number(body, "temperature", 1.0, low=0.0, high=MAX_TEMPERATURE),
        "top_p": _top_p(body),
        "seed": _seed(body),
        "stop": _stop(body.get("stop"), limits),
        "stream": _bool(body, "stream"),
        "include_usage": _include_usage(body),
    }


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, default in _UNSUPPORTED_UNLESS.items():
        value = body.get(name)
        # bool is an int in Python: logprobs=0 (a completion's "the chosen token's logprob")
        # must not pass as False, nor n=True as 1
        same_kind = isinstance(value, bool) == isinstance(default, bool)
        if value is not None and not (same_kind and value == default):
            raise RequestError(
                f"{name}={value!r} is not supported by this server", param=name, code="unsupported"
            )


def _max_tokens(body: dict[str, Any], name: str, limits: GatewayLimits) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= limits.max_tokens:
        raise RequestError(
            f"{name} must be an integer in [1, {limits.max_tokens}], got {value!r}", param=name
        )
    return value


def _number(body: dict[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise RequestError(f"{name} must be a number in [{low:g}, {high:g}]", param=name)
    return float(value)


def _top_p(body: dict[str, Any]) -> float:
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be in (0, 1]", param="top_p")
    return top_p


def _seed(body: dict[str, Any]) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    if not _is_int(seed) or not 0 <= seed < 2**63:
        raise RequestError("seed must be an integer in [0, 2**63)", param="seed")
    return seed


def _stop(value: Any, limits: GatewayLimits) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > limits.max_stop:
        raise RequestError(f"at most {limits.max_stop} stop strings", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise RequestError(
            f"a stop string may hold {limits.max_stop_chars} characters", param="stop"
        )
    return tuple(_unicode(s, "stop") for s in stops)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false", param=name)
    return value


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not body.get("stream"):
        raise RequestError(
            "stream_options is an object, allowed with stream only", param="stream_options"
        )
    return _bool(options, "include_usage")


def _message(item: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(item, dict):
        raise RequestError(f"{param} must be an object", param=param)
    role = item.get("role")
    if role not in ROLES:
        raise RequestError(f"{param}.role must be one of {list(ROLES)}", param=f"{param}.role")
    content = _content(item.get("content"), f"{param}.content")
    return ChatMessage(role=role, content=_unicode(content, f"{param}.content"))


def _content(content: Any, param: str) -> str:
    """A string, or a list of text parts ({"type": "text", "text": ...}) joined together."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{param}: only text parts are supported", param=param)
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{param}: a text part needs a string 'text'", param=param)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{param} must be a string or a list of text parts", param=param)


def _unicode(text: str, param: str) -> str:
    """``text`` if it is valid Unicode: JSON's escapes can spell a lone surrogate ("\\ud800"),
    which no UTF-8 encoder or tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{param} is not valid Unicode: {exc.reason}", param=param) from exc
    return text


def too_long(length: int, limits: GatewayLimits, param: str) -> RequestError:
    """The refusal of a prompt over ``limits.max_prompt_tokens`` (ids, or text once tokenized)."""
    return RequestError(
        f"the prompt has {length} tokens; at most {limits.max_prompt_tokens} are accepted",
        param=param,
        code="context_length_exceeded",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
