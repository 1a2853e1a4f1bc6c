"""``LocalSource``: generation with the whole model in this process, with a KV cache.

The reference the swarm must equal token for token, and what the benchmark compares the
swarm against. Each step runs in a worker thread so that an event loop serving other clients
(the gateway) is not blocked by compute.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch
from torch import nn

from fusionllm.common.logs import get_logger
from fusionllm.dag.models.decoding import CachedSpan, Span
from fusionllm.dag.models.pretrained import from_pretrained
from fusionllm.node.serve.api import SamplingParams, check_prompt, next_token

logger = get_logger(__name__)


class LocalSource:
    """A ``TokenSource`` over a model in this process (eval mode, no gradients)."""

    def __init__(self, model: nn.Module, *, name: str = "local") -> None:
        layers = model.config.num_hidden_layers
        self._span = CachedSpan(model.eval(), Span(start=0, stop=layers, layers=layers))
        self._name = name
        self._device = next(model.parameters()).device

    @classmethod
    def from_folder(cls, folder: str | Path) -> "LocalSource":
        return cls(from_pretrained(folder), name=Path(folder).name)

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._span.config.vocab_size

    @property
    def max_context(self) -> int:
        return self._span.config.block_size

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        check_prompt(prompt_ids, params, self)
        cache = self._span.new_cache(len(prompt_ids) + params.max_new_tokens, device=self._device)
        gen = params.generator()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=self._device)  # (1, T)
        for _ in range(params.max_new_tokens):
            logits = await asyncio.to_thread(self._span.forward, ids, cache)  # (1, T, V)
            token = next_token(logits[0, -1], params, gen, self.vocab_size)
            yield token
            if token in params.stop_ids:
                return
            ids = torch.tensor([[token]], dtype=torch.int64, device=self._device)  # (1, 1)

    async def aclose(self) -> None:
        """Nothing is held between requests: each stream's cache goes with it."""


async def generate(source, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """Every new id of one request, for callers that do not stream."""
    out: list[int] = []
    stream = source.stream(prompt_ids, params)
    try:
        async for token in stream:
            out.append(token)
    finally:
        await stream.aclose()
    return out
