"""Chat turns into one prompt string: the fixed role-tagged format, or ChatML when a model has it.

A ``tokenizer_config.json`` ``chat_template`` is a Jinja program; we do not run a model folder's
programs. Instead:

- a template that uses ChatML's markers, when the tokenizer has both as tokens
  (``<|im_start|>`` and ``<|im_end|>``, as Qwen's and many fine-tunes' do), is rendered as ChatML::

      <|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n
      <|im_start|>assistant\\n

  (one string: the line is broken here only)

  and ``<|im_end|>`` ends the reply (a stop id);
- any other model gets the fixed format below, each turn a role tag on its own line, then the
  text; the reply ends where the model starts a new turn (``\\n<|`` is a stop string)::

      <|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROLES = ("system", "developer", "user", "assistant")
_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True, kw_only=True)
class ChatStyle:
    """How turns become a prompt, and what ends the assistant's reply."""

    name: str  # "role-tags" or "chatml"
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for the assistant's next reply (an open assistant turn at the end)."""
        if self.name == "chatml":
            turns = [f"{_IM_START}{m.role}\n{m.content}{_IM_END}\n" for m in messages]
            return "".join(turns) + f"{_IM_START}assistant\n"
        turns = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
        return "".join(turns) + "<|assistant|>\n"


ROLE_TAGS = ChatStyle(name="role-tags", stop_strings=("\n<|",))


def chat_style_of(template: str | None, *, token_id: Callable[[str], int | None]) -> ChatStyle:
    """ChatML when the folder's template uses it and the tokenizer knows both markers."""
    if template is not None and _IM_START in template and _IM_END in template:
        start, end = token_id(_IM_START), token_id(_IM_END)
        if start is not None and end is not None:
            return ChatStyle(name="chatml", stop_ids=(end,), stop_strings=(_IM_END,))
    return ROLE_TAGS
