"""Fuzz targets of the control plane (benchmarks/fuzz.py): DHT envelopes, link gossip, the
training board's frames and plan records. The catalogue is fuzz_targets.py."""

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch
from fuzz_frame_targets import SMALL_LIMITS, Target, _msgpack_tree, split_frame

from fusionllm.common.errors import FrameError
from fusionllm.compression import (
    pack_tensor,
    unpack_tensor,
)
from fusionllm.dht import envelope as envelope_module
from fusionllm.dht.envelope import open_envelope, seal
from fusionllm.dht.records import (
    DeviceInfo,
    LinkReport,
    NodeInfo,
    NodeState,
    PlanProposal,
    RecordError,
)
from fusionllm.dht.wire import MessageError, PipeClosedError, read_tagged, write_message
from fusionllm.node.control.bandwidth import BandwidthReport
from fusionllm.node.control.links import gossip_validator
from fusionllm.node.p2p.framing import (
    FrameHeader,
    FrameKind,
    encode_head,
)
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.node.p2p.transport import Received
from fusionllm.node.training import board as board_module
from fusionllm.node.training.holdings import Holding


class _Signer:
    def __init__(self, path: Path) -> None:
        self.key_pair = load_or_create_identity(path)
        self.peer_id = peer_id_of(self.key_pair)

    def __call__(self, data: bytes) -> bytes:
        return self.key_pair.private_key.sign(data)


def _node_info(peer_id: str, links: int) -> NodeInfo:
    return NodeInfo(
        peer_id=peer_id,
        swarm="fuzz",
        addrs=(f"/ip4/10.0.0.1/tcp/4001/p2p/{peer_id}",),
        dht_addrs=("/ip4/10.0.0.1/tcp/4002",),
        device=DeviceInfo(
            name="cpu",
            kind="cpu",
            memory_bytes=8 << 30,
            flops=1e11,
            memory_bandwidth=2e10,
            op_overhead=1e-5,
            cpu_cores=4,
            ram_bytes=8 << 30,
        ),
        uplink=1e7,
        downlink=1e8,
        links=tuple(
            LinkReport(peer=f"peer{i}", bandwidth=1e6, rtt=0.01, age=1.0) for i in range(links)
        ),
        software="fusionllm 0.1.0",
        config_digest="0123456789abcdef",
        state=NodeState.SERVING,
        stage=1,
        adopted=(3, "ab" * 32),
        time=1.7e9,
    )


def _envelope_seeds(signer: _Signer) -> list[tuple[bytes, Any]]:
    key = "fusionllm/fuzz/nodes"
    seeds = []
    for links in (0, 3):
        info = _node_info(signer.peer_id, links)
        seeds.append(
            (seal(info, key=key, subkey=signer.peer_id, expiration=1.7e9, sign=signer), None)
        )
    proposal = PlanProposal(
        swarm="fuzz", epoch=4, proposer=signer.peer_id, estimate=0.5, plan=b'{"a":1}'
    )
    plan_key = "fusionllm/fuzz/plans/4"
    seeds.append(
        (seal(proposal, key=plan_key, subkey=signer.peer_id, expiration=1.7e9, sign=signer), None)
    )
    return seeds


def _envelope_tree(signer: _Signer) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    """The envelope with its body unpacked; re-signed after damage, so that the body parser
    (behind the signature check) sees the damage too."""

    def decode(data: bytes) -> Any:
        envelope = msgpack.unpackb(data, raw=False)
        envelope["body"] = msgpack.unpackb(envelope["body"], raw=False)
        return envelope

    def encode(tree: Any) -> bytes:
        if isinstance(tree, dict) and "body" in tree:
            tree = dict(tree)
            try:
                tree["body"] = msgpack.packb(tree["body"], use_bin_type=True)
                fields = [tree.get(k) for k in ("kind", "key", "sub", "exp")]
                signed = envelope_module._signed_bytes(*fields, tree["body"])
                tree["sig"] = signer(signed)
            except (TypeError, ValueError, AttributeError):
                pass  # fields too damaged to sign: the envelope goes out unsigned
        return msgpack.packb(tree, use_bin_type=True)

    return decode, encode


def dht_targets(workdir: Path) -> list[Target]:
    signer = _Signer(workdir / "fuzz.key")
    pipe_seeds = []
    for message in ({"ok": True, "items": [["s", b"v" * 40, 1.5]]}, {"op": "get", "key": "k"}):
        stream = io.BytesIO()
        write_message(stream, message, tag=7)
        write_message(stream, {"ok": True, "stored": True}, tag=8)
        pipe_seeds.append((stream.getvalue(), None))
    return [
        Target(
            name="DHT envelope",
            seeds=_envelope_seeds(signer),
            decode=lambda data, _c: open_envelope(data),
            allowed=(RecordError,),
            tree=_envelope_tree(signer),
        ),
        Target(
            name="DHT pipe",
            seeds=pipe_seeds,
            decode=_read_pipe,
            allowed=(MessageError, PipeClosedError),
        ),
    ]


def _read_pipe(data: bytes, _context: Any) -> list[Any]:
    """Every message on a damaged pipe until it ends; a refused message does not stop it."""
    stream, messages = io.BytesIO(data), []
    while stream.tell() < len(data):
        try:
            messages.append(read_tagged(stream, max_bytes=1 << 16))
        except MessageError:
            continue
    return messages


# ----------------------------------------------------------------------------- gossip


def gossip_target() -> Target:
    # Every author a member: the fuzzed bytes reach the report parser behind the member check.
    validate = gossip_validator("fusionllm/fuzz/bw", "fuzz", lambda author: True)
    seeds = []
    for n in (0, 1, 4):
        links = tuple(
            LinkReport(peer=f"peer{i}", bandwidth=1e6 * (i + 1), rtt=0.01, age=2.0)
            for i in range(n)
        )
        seeds.append((BandwidthReport(swarm="fuzz", time=1.7e9, links=links).to_bytes(), None))

    def decode(data: bytes, _context: Any) -> BandwidthReport:
        verdict = validate("fusionllm/fuzz/bw", "author", data)  # must answer, never raise
        assert isinstance(verdict, bool)
        report = BandwidthReport.from_bytes(data)
        assert verdict == (report.swarm == "fuzz"), "validator and parser disagree"
        return report

    return Target(
        name="gossip report",
        seeds=seeds,
        decode=decode,
        allowed=(RecordError,),
        tree=_msgpack_tree(),
    )


# ----------------------------------------------------------------------------- training board


_SHAPES = {"b": (3,), "w": (4, 3)}


def _board_frame(micro_batch: int, step: int, body: torch.Tensor) -> bytes:
    header = FrameHeader(step=step, micro_batch=micro_batch, kind=FrameKind.CONTROL, stage=0)
    packed = pack_tensor(body)
    return encode_head(header, len(packed)) + packed


def _board_seeds() -> list[tuple[bytes, Any]]:
    tags = board_module
    ready = tags.encode_ready(1.5, [Holding(3, 0, 4), Holding(2, 4, 9)], round=1, hint=3)
    state = torch.randn(3 * 3 + 1)
    weights = torch.randn(3 * 12 + 1)
    bodies = [
        (tags.TAG_READY, 0, ready),
        (tags.TAG_WANT, 0, torch.tensor([5.0], dtype=torch.float64)),
        (tags.TAG_MANIFEST, 4, torch.tensor([4, 0, 4, 2, 12345], dtype=torch.float64)),
        (tags.TAG_STATE, 4, state),
        (tags.TAG_STATE + 1, 4, weights),
        (tags.TAG_CUSTODY, 4, state),
        (tags.TAG_CUSTODY + 1, 4, weights),
    ]
    return [(_board_frame(tag, step, body), "member") for tag, step, body in bodies]


class _BoardPath:
    """Head, then body, then the board, as the transport and router hand a frame on."""

    def __init__(self) -> None:
        self.copies = 0
        self._fresh()

    def _fresh(self) -> None:
        self.board = board_module.Board(
            shapes=_SHAPES,
            is_member=lambda peer: peer == "member",
            on_copy=lambda _copy: None,
            on_want=lambda _peer, _hint: None,
        )
        self.frames = 0

    def __call__(self, data: bytes, context: Any) -> None:
        self.frames += 1
        if self.frames >= 200:  # a board lives one plan; bound what it keeps between runs
            self._fresh()
        header, body_len, body = split_frame(data)
        spec = self.board.expect(header)
        if spec is None:
            raise FrameError("not a board frame")
        if len(body) < body_len:
            raise FrameError("stream ended inside the body")
        body = body[:body_len]
        tensor = unpack_tensor(
            body, limits=SMALL_LIMITS, expect_dtype=spec.dtype, expect_shape=spec.shape
        )
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
            raise FrameError("not the tensor the board expected")
        self.board.put(Received(peer=context, header=header, tensor=tensor))


def board_target() -> Target:
    return Target(
        name="training board",
        seeds=_board_seeds(),
        decode=_BoardPath(),
        allowed=(FrameError,),
        tree=_board_tree(),
    )


def _board_tree() -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    """[micro_batch, step, values]: the fuzzer damages numbers (NaN, huge, negative, fractions)
    and lengths; encoded back as a well-formed frame, so the board's own checks are what run."""

    def decode(data: bytes) -> Any:
        header, _body_len, body = split_frame(data)
        return [header.micro_batch, header.step, unpack_tensor(body).tolist()]

    def encode(tree: Any) -> bytes:
        try:
            micro_batch, step, values = tree
            body = torch.tensor(
                values,
                dtype=torch.float64 if micro_batch < board_module.TAG_STATE else torch.float32,
            )
            return _board_frame(int(micro_batch), int(step), body.reshape(-1))
        except (TypeError, ValueError, OverflowError, RuntimeError):
            return b""  # not a frame any more: the byte-level path covers junk

    return decode, encode


# ----------------------------------------------------------------------------- plans


def plan_target() -> Target:
    from fusionllm.dag.cost import DeviceProfile
    from fusionllm.dag.plan_wire import PlanWireError, plan_from_json, plan_to_json
    from fusionllm.dag.planner import PlanConfig, plan
    from fusionllm.dag.swarm import Peer, Swarm
    from fusionllm.dag.synthetic import gpt2_costs

    device = DeviceProfile(name="gpu", flops=1e12, memory_bandwidth=1e11, memory_bytes=8 << 30)
    seeds = []
    for n in (2, 4):
        peers = [
            Peer(peer_id=f"peer{i}", device=device, uplink=1e9, downlink=1e9) for i in range(n)
        ]
        made = plan(
            gpt2_costs("small", batch=1, seq=128),
            Swarm.from_links(peers),
            PlanConfig(micro_batches=4, batch_size=8),
        )
        seeds.append((plan_to_json(made), None))
    return Target(
        name="plan JSON",
        seeds=seeds,
        decode=lambda data, _c: plan_from_json(data),
        allowed=(PlanWireError,),
        tree=(json.loads, lambda tree: json.dumps(tree).encode()),
    )
