"""The contract between whoever produces tokens and whoever asks for them.

``fusionllm generate``, the OpenAI-compatible gateway and local generation in one process all
speak it: a ``TokenSource`` streams the ids that follow a prompt under ``SamplingParams``.
Sampling lives here, once, so that the swarm's client and a local model pick the same token
from the same logits with the same seed, which is what makes their outputs comparable.
"""

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fusionllm.common.errors import ConfigError, FusionError, PeerError

# Limits as data: a request beyond them is refused before any work is done.
MAX_NEW_TOKENS = 4096
MAX_TEMPERATURE = 100.0


class ServeError(FusionError):
    """Generation could not be served; the message says why and what to try."""


class NoServingPlanError(ServeError):
    """No serving plan for the asked model was found on the DHT."""


class SessionLostError(ServeError):
    """A session's route broke and could not be rebuilt within its deadline."""


class OverloadedError(ServeError):
    """The server refuses new sessions until some end (count or bytes of KV caches at a bound)."""


class BadLogitsError(PeerError):
    """Logits a stage sent are not a finite float vector of the model's vocabulary size."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen; temperature 0 is greedy (argmax, no randomness)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}]")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ConfigError(f"temperature must be in [0, {MAX_TEMPERATURE}]")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ConfigError("top_p must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError("seed must be in [0, 2**63)")
        if any(not 0 <= i < 2**31 for i in self.stop_ids):
            raise ConfigError("stop_ids must be token ids in [0, 2**31)")

    def generator(self) -> torch.Generator | None:
        """The sampling generator of one request: None when greedy, seeded when asked."""
        if self.temperature == 0.0:
            return None
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def next_token(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None, vocab: int
) -> int:
    """The id that follows, from the last position's logits; refuses logits a peer got wrong.

    ``gen`` comes from ``params.generator()`` once per request, so a seeded request draws
    the same tokens wherever it runs. Sampling is on the CPU in float32 for the same reason.
    """
    if logits.shape != (vocab,) or not logits.is_floating_point():
        raise BadLogitsError(f"logits must be float of shape ({vocab},), got {tuple(logits.shape)}")
    scores = logits.detach().to("cpu", torch.float32)  # (V,)
    if not bool(torch.isfinite(scores).all()):
        raise BadLogitsError("logits are not all finite")
    if params.temperature == 0.0:
        return int(torch.argmax(scores))
    probs = torch.softmax(scores / params.temperature, dim=-1)  # (V,)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=gen))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely ids whose mass reaches top_p (always the first)."""
    sorted_probs, order = torch.sort(probs, descending=True)  # (V,), (V,)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the ids ahead
    keep = before < top_p
    kept = torch.zeros_like(probs)
    kept[order[keep]] = sorted_probs[keep]
    return kept / kept.sum()


class TokenSource(Protocol):
    """Something that continues prompts: the swarm's client, or a model in this process."""

    @property
    def model_name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int:
        """Prompt plus new tokens may not exceed this many positions."""
        ...

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        """The new ids one by one as they are chosen; stops at max_new_tokens or a stop id
        (which is yielded). Raises ServeError subclasses; closing the iterator ends the
        session and frees its caches."""
        ...

    async def aclose(self) -> None: ...


def check_prompt(prompt_ids: Sequence[int], params: SamplingParams, source: TokenSource) -> None:
    """Refuse a prompt the source cannot continue, before any session is opened."""
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    if any(not isinstance(i, int) or not 0 <= i < source.vocab_size for i in prompt_ids):
        raise ConfigError(f"prompt ids must be ints in [0, {source.vocab_size})")
    if len(prompt_ids) + params.max_new_tokens > source.max_context:
        raise ConfigError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
            f"the model's context of {source.max_context}"
        )
