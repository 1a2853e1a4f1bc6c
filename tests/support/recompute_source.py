"""A TokenSource over a whole model in this process, recomputing every position for each token.

What the gateway's tests run against until the serving side's own sources are merged: slow
(no KV cache: a token costs a forward pass over the whole sequence) but plainly correct, and it
samples with ``api.next_token`` as every source must. ``token_delay_s`` stands for a swarm's
per-token latency, so that tests can hold requests open; ``opened`` counts sessions and
``lengths`` holds the ids each closed session yielded.
"""

from collections.abc import AsyncIterator, Sequence

import anyio
import torch
from torch import nn

from fusionllm.node.serve.api import SamplingParams, check_prompt, next_token


class RecomputeSource:
    def __init__(self, model: nn.Module, *, name: str, token_delay_s: float = 0.0) -> None:
        self._model = model.eval()
        self._name = name
        self._delay_s = token_delay_s
        self.opened = 0
        self.lengths: list[int] = []

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._model.config.vocab_size

    @property
    def max_context(self) -> int:
        return self._model.config.block_size

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        check_prompt(prompt_ids, params, self)
        gen = params.generator()
        ids = list(prompt_ids)
        self.opened += 1
        yielded = 0
        try:
            for _ in range(params.max_new_tokens):
                logits = await anyio.to_thread.run_sync(self._last_logits, ids)  # (V,)
                if self._delay_s:
                    await anyio.sleep(self._delay_s)
                token = next_token(logits, params, gen, self.vocab_size)
                ids.append(token)
                yielded += 1
                yield token
                if token in params.stop_ids:
                    return
        finally:
            self.lengths.append(yielded)

    def _last_logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            idx = torch.tensor([ids], dtype=torch.int64)  # (1, T)
            return self._model(idx)[0, -1]  # (V,)

    async def aclose(self) -> None:
        return None


def generate_ids(model: nn.Module, prompt_ids: Sequence[int], steps: int) -> list[int]:
    """Greedy continuation by the plain loop (the reference the sources are compared with)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids], dtype=torch.int64))[0, -1]  # (V,)
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids) :]
