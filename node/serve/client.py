"""``SwarmSource``: generation through a serving swarm by a client that is not a member.

``connect_swarm`` starts a client-mode DHT (reads only) and a py-libp2p host with a throwaway
identity, finds the most followed plan, and asks one of its peers what model it serves. A
request (``stream``) then opens one session per stage of the route (``chain.Chain``), sends
the prompt through it (prefill) and one token at a time after. The client drives the chain:
it sends each stage's input and gets its output back, so it can replace any hop. When a hop
breaks (its node died, or it answered what a stage must not), the client drops the whole
chain, reads the plan again (a replica of the lost stage, or the re-planned route), opens new
sessions and replays the prompt and every token so far to rebuild their caches, as Petals
does; it logs that it did. Sampling is ``api.next_token``'s, so a seeded request draws the
same tokens as ``LocalSource``.
"""

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import SwarmKey
from fusionllm.dht.client import DhtClient, DhtConfig
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.serve.api import (
    NoServingPlanError,
    SamplingParams,
    SessionLostError,
    check_prompt,
    next_token,
)
from fusionllm.node.serve.chain import Chain, ChainConfig, HopLostError, model_info
from fusionllm.node.serve.route import read_plan

logger = get_logger(__name__)


class SwarmSource:
    """A ``TokenSource`` over a serving swarm (see the module's docstring)."""

    def __init__(self, *, host: PeerHost, dht: DhtClient, config: ChainConfig, info: dict):
        self._host = host
        self._dht = dht
        self._config = config
        self._info = info
        self.recoveries = 0  # chains rebuilt after a lost hop, over this source's life
        self.peers_in_use: list[str] = []  # the last chain opened: one peer per stage

    @property
    def model_name(self) -> str:
        return self._info["model"]

    @property
    def vocab_size(self) -> int:
        return self._info["vocab"]

    @property
    def max_context(self) -> int:
        return self._info["context"]

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[int]:
        check_prompt(prompt_ids, params, self)
        max_len = len(prompt_ids) + params.max_new_tokens
        chain = Chain(self._host, self._config, info=self._info, max_len=max_len)
        tokens, gen = list(prompt_ids), params.generator()
        try:
            fed = 0  # positions the chain's caches hold
            for _ in range(params.max_new_tokens):
                logits = await self._run(chain, tokens, fed)  # (V,)
                fed = len(tokens)
                token = next_token(logits, params, gen, self.vocab_size)
                yield token
                if token in params.stop_ids:
                    return
                tokens.append(token)
        finally:
            await asyncio.to_thread(chain.close)

    async def _run(self, chain: Chain, tokens: list[int], fed: int):
        """The last position's logits after feeding tokens[fed:]; a lost hop rebuilds the
        chain and replays every token (within the timeout, else SessionLostError)."""
        deadline = time.monotonic() + self._config.timeout_s
        while True:
            try:
                if not chain.hops:
                    plan = await self._plan(deadline)
                    await asyncio.to_thread(chain.open, plan)
                    self.peers_in_use = [hop.peer for hop in chain.hops]
                    fed = 0
                return await asyncio.to_thread(chain.forward, tokens[fed:], fed)
            except HopLostError as lost:
                self.recoveries += 1
                logger.warning(
                    "stage %d on %s lost (%s): moving to a replica or the re-planned route and "
                    "replaying %d positions to rebuild the caches",
                    lost.stage,
                    lost.peer[:16],
                    lost.reason,
                    len(tokens),
                )
                await asyncio.to_thread(chain.drop, lost.peer)
                if time.monotonic() > deadline:
                    raise SessionLostError(
                        f"the route broke at stage {lost.stage} and was not rebuilt within "
                        f"{self._config.timeout_s} s: {lost.reason}"
                    ) from lost

    async def _plan(self, deadline: float):
        while True:
            plan = await asyncio.to_thread(read_plan, self._dht, self._config.swarm)
            if plan is not None:
                return plan
            if time.monotonic() > deadline:
                raise NoServingPlanError(f"no serving plan in swarm {self._config.swarm!r}")
            await asyncio.sleep(0.5)

    async def aclose(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self._host.close()
        self._dht.close()


async def connect_swarm(
    bootstrap: list[str],
    *,
    model: str | None,
    timeout: float,
    swarm_key: SwarmKey | None = None,
    swarm: str = "default",
    fp16: bool = False,
) -> SwarmSource:
    """A started ``SwarmSource`` on the swarm that ``bootstrap`` (DHT multiaddrs) reaches;
    ``model``: refuse a swarm serving another model (its folder's name)."""
    return await asyncio.to_thread(_connect, bootstrap, model, timeout, swarm_key, swarm, fp16)


def _client_host(swarm_key: SwarmKey | None) -> PeerHost:
    """A host with a fresh identity whose key file is gone once it returns: PeerHost holds
    its key in memory from construction, and a client's throwaway key left in the temporary
    folder would pile up one folder per run."""
    with tempfile.TemporaryDirectory(prefix="fusionllm-client-") as folder:
        return PeerHost(HostConfig(key_path=Path(folder) / "client.key", swarm_key=swarm_key))


def _connect(bootstrap, model, timeout, swarm_key, swarm, fp16) -> SwarmSource:
    config = ChainConfig(swarm=swarm, timeout_s=timeout, fp16=fp16)
    dht = DhtClient(
        DhtConfig(
            swarm=swarm,
            initial_peers=tuple(bootstrap),
            client_mode=True,
            start_timeout_s=timeout,
            record_tag_key=swarm_key.records.key_hex if swarm_key is not None else "",
        )
    ).start()
    host = None
    try:
        host = _client_host(swarm_key).start()
        deadline = time.monotonic() + timeout
        while (plan := read_plan(dht, swarm)) is None:
            if time.monotonic() > deadline:
                raise NoServingPlanError(f"no serving plan in swarm {swarm!r} after {timeout} s")
            time.sleep(0.5)
        info = model_info(host, plan, config)
        if model is not None and info["model"] != model:
            raise NoServingPlanError(f"the swarm serves {info['model']!r}, not {model!r}")
        return SwarmSource(host=host, dht=dht, config=config, info=info)
    except BaseException:
        if host is not None:
            host.close()
        dht.close()
        raise


__all__ = ["FusionError", "SwarmSource", "connect_swarm"]
