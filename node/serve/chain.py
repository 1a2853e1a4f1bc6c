"""One request's sessions along a route: a stream per stage, opened, stepped and closed.

The methods are plain (they block): the client calls them from a worker thread, and each
network exchange runs in the py-libp2p host's trio thread (``PeerHost.call``). Whatever a
hop answers is checked (shape, dtype, finiteness, its span) before use; a hop that breaks or
answers wrong is ``HopLostError``, and the client rebuilds the chain without it.
"""

import random
from dataclasses import dataclass

import torch
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError, FrameError
from fusionllm.common.logs import get_logger
from fusionllm.compression.codecs import Float16Codec
from fusionllm.compression.frame import pack_tensor, unpack_tensor
from fusionllm.compression.limits import FrameLimits
from fusionllm.node.errors import DeadlineError, TransportError
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, PeerHost, close_quietly
from fusionllm.node.serve.api import OverloadedError, ServeError
from fusionllm.node.serve.layout import RouteStage, serving_route
from fusionllm.node.serve.route import SwarmPlan
from fusionllm.node.serve.wire import PROTOCOL, ServeWireError, field, receive, send

logger = get_logger(__name__)
_MAX_VOCAB = 1 << 22
_MAX_WIDTH = 1 << 16
_LOST = (ServeWireError, FrameError, DeadlineError, TransportError, *NETWORK_ERRORS)


@dataclass(frozen=True, kw_only=True)
class ChainConfig:
    swarm: str = "default"
    timeout_s: float = 60.0  # to connect, and to rebuild a broken route
    step_timeout_s: float = 30.0  # one hop's answer
    fp16: bool = False  # the residual stream between stages as fp16 (logits stay fp32)

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.step_timeout_s > 0):
            raise ConfigError("timeouts must be > 0")


class HopLostError(ServeError):
    def __init__(self, stage: int, peer: str, reason: str) -> None:
        super().__init__(f"stage {stage} on {peer}: {reason}")
        self.stage, self.peer, self.reason = stage, peer, reason


@dataclass
class _Hop:
    stage: RouteStage
    peer: str
    stream: object


class Chain:
    def __init__(self, host: PeerHost, config: ChainConfig, *, info: dict, max_len: int):
        self.host, self.config, self.max_len = host, config, max_len
        self.layers, self.vocab = info["layers"], info["vocab"]
        self.hops: list[_Hop] = []
        self.dead: set[str] = set()  # peers that failed this request: never tried again
        self.width: int | None = None

    def open(self, plan: SwarmPlan) -> None:
        """A session on one live peer of every stage (replicas tried in random order, so
        several clients spread over them); HopLostError if a stage has none left."""
        for stage in serving_route(plan.stage_peers, self.layers, plan.backup):
            peers = [p for p in stage.peers if p not in self.dead and plan.addrs.get(p)]
            random.shuffle(peers)
            if not peers:
                raise HopLostError(stage.index, "-", "no live replica in the plan")
            self.hops.append(self._first_open(stage, peers, plan))

    def _first_open(self, stage: RouteStage, peers: list[str], plan: SwarmPlan) -> _Hop:
        refused: OverloadedError | None = None
        for peer in peers:
            try:
                return self._open_on(stage, peer, plan.addrs[peer])
            except OverloadedError as exc:
                refused = exc
            except HopLostError as exc:
                logger.info("could not open stage %d on %s: %s", stage.index, peer, exc.reason)
                self.dead.add(peer)
        if refused is not None:
            raise refused
        raise HopLostError(stage.index, peers[-1], "no replica of the stage answered")

    def _open_on(self, stage: RouteStage, peer: str, addrs: tuple[str, ...]) -> _Hop:
        message = {
            "op": "open",
            "span": [stage.start, stage.stop],
            "max_len": self.max_len,
            "fp16": self.config.fp16,
        }
        try:
            dial(self.host, addrs, self.config.timeout_s)
            stream, reply = self.host.call(self._open_stream, peer, message)
        except _LOST as exc:
            raise HopLostError(stage.index, peer, str(exc) or type(exc).__name__) from exc
        if not reply.get("ok"):
            if reply.get("error") == "overloaded":
                raise OverloadedError(f"stage {stage.index} on {peer}: {reply.get('msg')}")
            raise HopLostError(stage.index, peer, f"refused: {reply.get('msg')!r}")
        self.width = field(reply, "hidden", int, low=1, high=_MAX_WIDTH)
        return _Hop(stage=stage, peer=peer, stream=stream)

    async def _open_stream(self, peer: str, message: dict):
        stream = await self.host.libp2p.new_stream(ID.from_base58(peer), [PROTOCOL])
        try:
            await send(stream, message)
            return stream, await receive(stream, stall_timeout_s=self.config.step_timeout_s)
        except BaseException:
            await close_quietly(stream)
            raise

    def forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        """Feed ``tokens`` at ``pos`` through every hop; the last position's logits (V,)."""
        x = torch.tensor([tokens], dtype=torch.int64)  # (1, T)
        for hop in self.hops:
            x = self._step(hop, x, pos, len(tokens))
        return x

    def _step(self, hop: _Hop, x: torch.Tensor, pos: int, new: int) -> torch.Tensor:
        codec = Float16Codec() if self.config.fp16 and x.is_floating_point() else None
        message = {"op": "step", "pos": pos, "t": pack_tensor(x, codec)}
        try:
            reply = self.host.call(self._exchange, hop.stream, message)
            if not reply.get("ok"):
                raise ServeWireError(f"{reply.get('error')}: {reply.get('msg')!r}")
            frame = field(reply, "t", bytes)
            if hop.stage.stop == self.layers:
                return _checked(frame, (self.vocab,), self.vocab)  # (V,)
            return _checked(frame, (1, new, self.width), new * self.width)  # (1, T, C)
        except _LOST as exc:
            raise HopLostError(hop.stage.index, hop.peer, str(exc) or type(exc).__name__) from exc

    async def _exchange(self, stream, message: dict) -> dict:
        await send(stream, message)
        return await receive(stream, stall_timeout_s=self.config.step_timeout_s)

    def drop(self, lost: str | None = None) -> None:
        """Close every session (the caches go with them); ``lost`` is never tried again."""
        if lost is not None:
            self.dead.add(lost)
        hops, self.hops = self.hops, []
        for hop in hops:
            try:
                self.host.call(close_quietly, hop.stream)
            except Exception:  # the host is closing: the streams go with it
                logger.debug("closing a session failed", exc_info=True)

    def close(self) -> None:
        self.drop()


def _checked(frame: bytes, shape: tuple[int, ...], elements: int) -> torch.Tensor:
    limits = FrameLimits(max_elements=max(elements, 1), max_rank=len(shape))
    tensor = unpack_tensor(frame, limits=limits, expect_dtype=torch.float32)
    if tuple(tensor.shape) != shape:
        raise ServeWireError(f"expected shape {shape}, got {tuple(tensor.shape)}")
    return tensor


def dial(host: PeerHost, addrs: tuple[str, ...], timeout: float) -> None:
    errors = []
    for addr in addrs:
        try:
            host.connect(addr, timeout=min(timeout, 10.0))
            return
        except (TransportError, DeadlineError) as exc:
            errors.append(str(exc))
    raise TransportError(f"no address answered: {errors[:3]}")


def model_info(host: PeerHost, plan: SwarmPlan, config: ChainConfig) -> dict:
    """What the swarm serves, asked of the plan's peers in turn until one answers."""
    peers = [p for stage in plan.stage_peers for p in stage if plan.addrs.get(p)]
    peers += [p for p in plan.backup if plan.addrs.get(p)]
    for peer in peers:
        try:
            dial(host, plan.addrs[peer], config.timeout_s)
            stream, reply = host.call(_ask_info, host, peer, config.step_timeout_s)
            host.call(close_quietly, stream)
            if reply.get("ok"):
                return _info_fields(reply)
        except (*_LOST, ServeError) as exc:
            logger.info("%s did not say what it serves: %s", peer, exc)
    raise ServeError(f"none of {len(peers)} serving peers answered")


async def _ask_info(host: PeerHost, peer: str, timeout: float):
    stream = await host.libp2p.new_stream(ID.from_base58(peer), [PROTOCOL])
    await send(stream, {"op": "info"})
    return stream, await receive(stream, stall_timeout_s=timeout)


def _info_fields(reply: dict) -> dict:
    name = field(reply, "model", str)
    return {
        "model": name[:200],
        "layers": field(reply, "layers", int, low=1, high=1 << 16),
        "vocab": field(reply, "vocab", int, low=1, high=_MAX_VOCAB),
        "context": field(reply, "context", int, low=1, high=1 << 24),
    }
