"""The gateway's limits, as data: every request is held to them before any work is done.

Imports no torch (nor api.py, which does): ``fusionllm``'s parser reads the defaults here for
``gateway --help``, and every command builds that parser. ``gateway_app`` checks max_tokens
against api.MAX_NEW_TOKENS.
"""

from dataclasses import dataclass

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class GatewayLimits:
    max_body_bytes: int = 1 << 20  # a request's JSON body
    max_prompt_tokens: int = 8192  # also bounded by the model's context
    max_tokens: int = 1024  # the most a request may ask for
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    max_concurrent: int = 4  # requests generating at once; the next one gets 429
    max_messages: int = 256  # turns in one chat request
    max_stop: int = 4  # stop strings per request (OpenAI's limit)
    max_stop_chars: int = 256  # characters in one stop string
    # The longest wait for the next token (a prefill of a long prompt included) before the
    # request fails with 504 and its session is closed.
    idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_prompt_tokens",
            "max_tokens",
            "default_max_tokens",
            "max_concurrent",
            "max_messages",
            "max_stop",
            "max_stop_chars",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GatewayLimits.{name} must be an int >= 1, got {value!r}")
        idle = self.idle_timeout_s
        if isinstance(idle, bool) or not isinstance(idle, int | float) or not 0 < idle < 1e6:
            raise ConfigError(f"GatewayLimits.idle_timeout_s must be in (0, 1e6) s, got {idle!r}")
        if self.default_max_tokens > self.max_tokens:
            raise ConfigError(
                f"GatewayLimits.default_max_tokens ({self.default_max_tokens}) exceeds "
                f"max_tokens ({self.max_tokens})"
            )
