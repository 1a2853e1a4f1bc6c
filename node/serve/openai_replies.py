"""OpenAI's response bodies out: whole answers, stream chunks and server-sent events (pure)."""

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What every body of one answer repeats: its id, time, model, and whether it is a chat."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, *, chat: bool, model: str) -> "Reply":
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(
            chat=chat, model=model, id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time())
        )

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(
        self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> dict:
        """The non-streamed answer."""
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(
        self, text: str | None, finish_reason: str | None = None, *, role: bool = False
    ) -> dict:
        """One streamed chunk: text (chat: a delta, with the role in the first one), or the end."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk when the client asked for stream_options.include_usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body`` as JSON."""
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )
