"""What a node says about itself on the DHT, and the plans nodes propose: strict wire schemas.

Every record from a peer is untrusted. ``from_wire`` checks the exact key set, every type,
every range and every length before building anything, and raises ``RecordError`` (a
``PeerError``) for anything else, including a schema version it does not know: a reader logs
and skips such an entry, it never crashes on it.
"""

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

from fusionllm.common.errors import ConfigError, peer_repr
from fusionllm.dht import record_checks as check
from fusionllm.dht.record_checks import RecordError

NODE_INFO_VERSION = 1
# Whether peers can dial a node, as it judged from members' dial-backs (node/p2p/reachability.py)
REACH_VERDICTS = ("unknown", "public", "mapped", "private", "announced")
PLAN_PROPOSAL_VERSION = 1

MAX_ADDRS = 8
MAX_WIRE_BEAT = 64  # NodeInfo.beat on the wire; readers believe less (quiet.py)
MAX_ADDR_CHARS = 256
MAX_LINKS = 32
MAX_SUSPECTS = 16  # suspicions one record carries (node/control/suspicion.py)
MAX_STRIKES = 64
MAX_REASON_CHARS = 32
MAX_PACE = 1e6
MAX_STRETCH = 64.0  # node/control/stretch.py: a node's own work this many times its model's
MAX_WITNESSED = 16  # other members' paces one record carries (node/control/pace.py)
MAX_NAME_CHARS = 128
MAX_PEER_ID_CHARS = 128
MAX_PLAN_BYTES = 512 << 10
# Nodes are assumed NTP-close; a record dated further ahead than this is refused, or it would
# look fresh (and win "latest" comparisons) for as long as it lives.
MAX_CLOCK_SKEW_S = 5.0
_MAX_BYTES_PER_S = 1e15  # 8 Pb/s: anything above is a lie or a bug
_MAX_FLOPS = 1e18
_MAX_MEMORY = 1 << 50


class NodeState(enum.StrEnum):
    JOINING = "joining"
    BACKUP = "backup"
    SERVING = "serving"
    LEAVING = "leaving"


# ----------------------------------------------------------------------------- node records


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """The device a node trains on, as measured by the node itself (node/probe.py)."""

    name: str
    kind: str  # "cpu", "cuda", ...
    memory_bytes: int
    flops: float  # achieved fp32 matmul FLOP/s
    memory_bandwidth: float  # bytes/s achieved by element-wise training kernels
    op_overhead: float  # s per operator per pass
    cpu_cores: int
    ram_bytes: int
    frame_overhead: float = 0.0  # s of CPU per tensor frame sent or received (0: not measured)
    topk_frame_overhead: float = 0.0  # s of CPU per top-k frame, one side (0: not measured)
    topk_byte_cost: float = 0.0  # ... plus s per byte of the dense tensor it packs

    def __post_init__(self) -> None:
        try:
            DeviceInfo.from_wire(self.to_wire())
        except RecordError as exc:
            raise ConfigError(str(exc)) from exc

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "mem": self.memory_bytes,
            "flops": self.flops,
            "membw": self.memory_bandwidth,
            "ovh": self.op_overhead,
            "cores": self.cpu_cores,
            "ram": self.ram_bytes,
            # Only when measured: a record without it reads as before (0: no frame term).
            **({"frm": self.frame_overhead} if self.frame_overhead else {}),
            **({"tkf": self.topk_frame_overhead} if self.topk_frame_overhead else {}),
            **({"tkb": self.topk_byte_cost} if self.topk_byte_cost else {}),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> "DeviceInfo":
        w = check.fields(
            wire,
            {"name", "kind", "mem", "flops", "membw", "ovh", "cores", "ram"},
            "device",
            frozenset({"frm", "tkf", "tkb"}),
        )
        values = {
            "name": check.text(w["name"], "device name", MAX_NAME_CHARS),
            "kind": check.text(w["kind"], "device kind", 16),
            "memory_bytes": check.integer(w["mem"], "device memory", 1, _MAX_MEMORY),
            "flops": check.number(w["flops"], "device flops", 0.0, _MAX_FLOPS, low_open=True),
            "memory_bandwidth": check.number(
                w["membw"], "memory bandwidth", 0, 1e15, low_open=True
            ),
            "op_overhead": check.number(w["ovh"], "op overhead", 0.0, 1.0),
            "cpu_cores": check.integer(w["cores"], "cpu cores", 1, 1 << 16),
            "ram_bytes": check.integer(w["ram"], "ram", 1, _MAX_MEMORY),
            "frame_overhead": check.number(w.get("frm", 0.0), "frame overhead", 0.0, 1.0),
            "topk_frame_overhead": check.number(w.get("tkf", 0.0), "top-k frame", 0.0, 1.0),
            # s per byte: 1e-4 is 10 KB/s, slower than any device that could hold a stage.
            "topk_byte_cost": check.number(w.get("tkb", 0.0), "top-k byte cost", 0.0, 1e-4),
        }
        obj = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        return obj


@dataclass(frozen=True, kw_only=True)
class LinkReport:
    """One link this node measured itself: this node -> ``peer``."""

    peer: str
    bandwidth: float  # bytes/s
    rtt: float  # s
    age: float  # s since the measurement, at the record's time
    relayed: bool = False  # measured through a relay: the path this link's traffic takes
    punched: bool = False  # on a lane punched through NATs (a direct path, where dials fail)

    def __post_init__(self) -> None:
        if self.relayed and self.punched:
            raise RecordError("a link is relayed or punched, not both")

    def to_wire(self) -> list:
        # A fifth field only for a relayed (1) or punched (2) link: a direct one reads as before.
        path = [1] if self.relayed else [2] if self.punched else []
        return [self.peer, self.bandwidth, self.rtt, self.age, *path]

    @classmethod
    def from_wire(cls, wire: Any) -> "LinkReport":
        items = check.items(wire, "link", 5)
        if len(items) not in (4, 5):
            raise RecordError(f"link must have 4 or 5 fields, got {len(items)}")
        path = items[4] if len(items) == 5 else 0
        if len(items) == 5 and path not in (1, 2):
            raise RecordError(f"link's relayed field must be 1 (2: punched), got {peer_repr(path)}")
        return cls(
            peer=check.text(items[0], "link peer", MAX_PEER_ID_CHARS),
            bandwidth=check.number(
                items[1], "link bandwidth", 0.0, _MAX_BYTES_PER_S, low_open=True
            ),
            rtt=check.number(items[2], "link rtt", 0.0, 600.0),
            age=check.number(items[3], "link age", 0.0, 1e7),
            relayed=path == 1,
            punched=path == 2,
        )


@dataclass(frozen=True)
class TrainingProgress:
    """Where a node's training stands: what ``fusionllm status`` and a waiting backup read."""

    replica: int | None  # its replica of ``NodeInfo.stage`` while it serves
    step: int  # optimizer steps the swarm completed, as this node last saw them
    loss: float | None  # that step's mean loss (every stage learns it from the step's summary)
    finished: bool = False  # the run reached its last step
    # (step, loss) of the newest validation on the held-out split, if the run evaluates
    evaluation: tuple[int, float] | None = None

    def to_wire(self) -> list[Any]:
        wire = [self.replica, self.step, self.loss, self.finished]
        # A fifth field only when there is one: nodes that know four still read the rest.
        return wire if self.evaluation is None else [*wire, list(self.evaluation)]

    @classmethod
    def from_wire(cls, wire: Any) -> "TrainingProgress":
        items = check.items(wire, "training", 5)
        if len(items) not in (4, 5):
            raise RecordError(f"training must have 4 or 5 fields, got {len(items)}")
        evaluation = None
        if len(items) == 5:
            pair = check.items(items[4], "evaluation", 2)
            if len(pair) != 2:
                raise RecordError(f"evaluation must be (step, loss), got {len(pair)} fields")
            evaluation = (
                check.integer(pair[0], "eval step", 0, 1 << 62),
                check.number(pair[1], "eval loss", 0.0, 1e6),
            )
        replica = None if items[0] is None else check.integer(items[0], "replica", 0, 1 << 16)
        loss = None if items[2] is None else check.number(items[2], "loss", 0.0, 1e6)
        if not isinstance(items[3], bool):
            raise RecordError("training finished must be a bool")
        return cls(replica, check.integer(items[1], "step", 0, 1 << 62), loss, items[3], evaluation)


@dataclass(frozen=True)
class Suspicion:
    """A member this node waited for in vain: it keeps it out of plans until ``until``."""

    peer: str
    until: float  # wall clock
    reason: str  # short and printable, e.g. "barrier" (node/control/suspicion.py)
    strikes: int  # how many times in a row; the backoff doubled with each

    def to_wire(self) -> list[Any]:
        return [self.peer, self.until, self.reason, self.strikes]

    @classmethod
    def from_wire(cls, wire: Any) -> "Suspicion":
        items = check.exactly(wire, "suspicion", 4)
        return cls(
            check.text(items[0], "suspect", MAX_PEER_ID_CHARS),
            check.number(items[1], "suspected until", 0.0, 1e11),
            check.text(items[2], "suspicion reason", MAX_REASON_CHARS),
            check.integer(items[3], "strikes", 1, MAX_STRIKES),
        )


@dataclass(frozen=True)
class Witnessed:
    """How many times slower than its device another member of our plan computes, from the
    compute its step summaries gave (node/control/pace.py's ``PaceWitness``)."""

    peer: str
    pace: float

    def to_wire(self) -> list[Any]:
        return [self.peer, self.pace]

    @classmethod
    def from_wire(cls, wire: Any) -> "Witnessed":
        items = check.exactly(wire, "witnessed pace", 2)
        return cls(
            check.text(items[0], "witnessed peer", MAX_PEER_ID_CHARS),
            check.number(items[1], "witnessed pace", 1.0, MAX_PACE),
        )


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """A node's record under the swarm's key, subkey = its peer id, refreshed by a heartbeat."""

    peer_id: str
    swarm: str
    addrs: tuple[str, ...]  # data-plane (py-libp2p) multiaddrs, /p2p/<peer id> included
    dht_addrs: tuple[str, ...]  # where its DHT node listens: a newcomer may bootstrap from it
    device: DeviceInfo
    uplink: float  # bytes/s, best measured (or configured) estimate
    downlink: float
    links: tuple[LinkReport, ...]
    software: str
    config_digest: str  # the swarm settings it runs with: nodes plan only with matching peers
    state: NodeState
    stage: int | None  # the stage it serves when state is SERVING
    adopted: tuple[int, str] | None  # (epoch, plan digest) of the plan it follows
    time: float  # wall clock when written
    training: TrainingProgress | None = None
    # How many heartbeats this record may go unrefreshed: > 1 only in a quiet swarm
    # (node/control/quiet.py); readers cap what they believe of it.
    beat: int = 1
    # An observer (``fusionllm node --no-train``) follows the swarm and trains nothing: no
    # plan may seat it. Old records lack the field: they are members as before.
    observer: bool = False
    suspects: tuple[Suspicion, ...] = ()  # members it waited for in vain (suspicion.py)
    # How many times slower than its device it measured itself (node/control/pace.py): every
    # planner divides the device's figures by it. Old records lack it: 1, as advertised.
    pace: float = 1.0
    # Paces of the other members of its plan, measured from their step summaries (pace.py):
    # planners believe those over a member's own ``pace``. Old records lack it: none.
    witnessed: tuple[Witnessed, ...] = ()
    # Whether peers can dial it (node/p2p/reachability.py): one of REACH_VERDICTS. Old
    # records and nodes that have not judged yet lack it: "".
    reach: str = ""
    # How many times longer its own work in a step (compute, frames, the schedule's
    # bookkeeping, the update, at its CPU share) took than the planner's model of it
    # (node/control/stretch.py). 0: not measured yet (old records too).
    stretch: float = 0.0

    def __post_init__(self) -> None:
        try:
            NodeInfo.from_wire(self.to_wire())
        except RecordError as exc:
            raise ConfigError(str(exc)) from exc

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": NODE_INFO_VERSION,
            "id": self.peer_id,
            "swarm": self.swarm,
            "addrs": list(self.addrs),
            "dht": list(self.dht_addrs),
            "dev": self.device.to_wire(),
            "up": self.uplink,
            "down": self.downlink,
            "links": [link.to_wire() for link in self.links],
            "sw": self.software,
            "cfg": self.config_digest,
            "state": str(self.state),
            "stage": self.stage,
            "plan": list(self.adopted) if self.adopted is not None else None,
            "t": self.time,
            **({"train": self.training.to_wire()} if self.training is not None else {}),
            **({"beat": self.beat} if self.beat != 1 else {}),
            **({"obs": True} if self.observer else {}),
            **({"sus": [x.to_wire() for x in self.suspects]} if self.suspects else {}),
            **({"pace": self.pace} if self.pace != 1.0 else {}),
            **({"wit": [x.to_wire() for x in self.witnessed]} if self.witnessed else {}),
            **({"reach": self.reach} if self.reach else {}),
            **({"str": self.stretch} if self.stretch else {}),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> "NodeInfo":
        check.version(wire, "node record", NODE_INFO_VERSION)
        keys = {"v", "id", "swarm", "addrs", "dht", "dev", "up", "down", "links", "sw", "state"}
        optional = frozenset({"train", "beat", "obs", "sus", "pace", "wit", "reach", "str"})
        w = check.fields(wire, keys | {"cfg", "stage", "plan", "t"}, "node record", optional)
        try:
            state = NodeState(w["state"])
        except ValueError:
            raise RecordError(
                f"node state {peer_repr(w['state'])} is not one of {list(NodeState)}"
            ) from None
        stage = None if w["stage"] is None else check.integer(w["stage"], "stage", 0, 1 << 16)
        adopted = None
        if w["plan"] is not None:
            pair = check.items(w["plan"], "adopted plan", 2)
            if len(pair) != 2:
                raise RecordError("adopted plan must be [epoch, digest]")
            adopted = (check.integer(pair[0], "adopted epoch", 0, 1 << 62), check.digest(pair[1]))
        obj = object.__new__(cls)
        values = {
            "peer_id": check.text(w["id"], "peer id", MAX_PEER_ID_CHARS),
            "swarm": check.text(w["swarm"], "swarm", MAX_NAME_CHARS),
            "addrs": tuple(
                check.text(a, "addr", MAX_ADDR_CHARS)
                for a in check.items(w["addrs"], "addrs", MAX_ADDRS)
            ),
            "dht_addrs": tuple(
                check.text(a, "dht addr", MAX_ADDR_CHARS)
                for a in check.items(w["dht"], "dht", MAX_ADDRS)
            ),
            "device": DeviceInfo.from_wire(w["dev"]),
            "uplink": check.number(w["up"], "uplink", 0.0, _MAX_BYTES_PER_S, low_open=True),
            "downlink": check.number(w["down"], "downlink", 0.0, _MAX_BYTES_PER_S, low_open=True),
            "links": tuple(
                LinkReport.from_wire(x) for x in check.items(w["links"], "links", MAX_LINKS)
            ),
            "software": check.text(w["sw"], "software", MAX_NAME_CHARS),
            "config_digest": check.text(w["cfg"], "config digest", 64),
            "state": state,
            "stage": stage,
            "adopted": adopted,
            "time": check.number(w["t"], "time", 0.0, 1e11),
            "training": TrainingProgress.from_wire(w["train"]) if "train" in w else None,
            "beat": check.integer(w["beat"], "beat", 1, MAX_WIRE_BEAT) if "beat" in w else 1,
            "observer": _observer(w.get("obs", False)),
            "suspects": tuple(
                Suspicion.from_wire(x)
                for x in check.items(w.get("sus", []), "suspects", MAX_SUSPECTS)
            ),
            "pace": check.number(w["pace"], "pace", 1.0, MAX_PACE) if "pace" in w else 1.0,
            "witnessed": tuple(
                Witnessed.from_wire(x)
                for x in check.items(w.get("wit", []), "witnessed", MAX_WITNESSED)
            ),
            "reach": _reach(w.get("reach", "")),
            "stretch": check.number(w["str"], "stretch", 1.0, MAX_STRETCH) if "str" in w else 0.0,
        }
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        return obj


def _reach(value: Any) -> str:
    if value != "" and value not in REACH_VERDICTS:
        raise RecordError(f"reach {peer_repr(value)} is not one of {list(REACH_VERDICTS)}")
    return value


def _observer(value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"observer must be a bool, got {type(value).__name__}")
    return value


# ----------------------------------------------------------------------------- plan proposals


@dataclass(frozen=True, kw_only=True)
class PlanProposal:
    """One node's plan for one epoch, stored under the epoch's key, subkey = the proposer.

    ``plan`` is the canonical JSON of the planner's ``Plan.to_dict()``; ``digest`` its sha256,
    which every node recomputes (it is the plan's identity and the tie-breaker).
    """

    swarm: str
    epoch: int
    proposer: str
    estimate: float  # estimated step time, s
    plan: bytes

    def __post_init__(self) -> None:
        try:
            PlanProposal.from_wire(self.to_wire())
        except RecordError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.plan).hexdigest()

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": PLAN_PROPOSAL_VERSION,
            "swarm": self.swarm,
            "epoch": self.epoch,
            "by": self.proposer,
            "est": self.estimate,
            "plan": self.plan,
        }

    @classmethod
    def from_wire(cls, wire: Any) -> "PlanProposal":
        check.version(wire, "plan proposal", PLAN_PROPOSAL_VERSION)
        w = check.fields(wire, {"v", "swarm", "epoch", "by", "est", "plan"}, "plan proposal")
        plan = w["plan"]
        if not isinstance(plan, bytes) or not 0 < len(plan) <= MAX_PLAN_BYTES:
            raise RecordError(f"plan must be 1..{MAX_PLAN_BYTES} bytes")
        obj = object.__new__(cls)
        values = {
            "swarm": check.text(w["swarm"], "swarm", MAX_NAME_CHARS),
            "epoch": check.integer(w["epoch"], "epoch", 0, 1 << 62),
            "proposer": check.text(w["by"], "proposer", MAX_PEER_ID_CHARS),
            "estimate": check.number(w["est"], "estimate", 0.0, 1e9, low_open=True),
            "plan": plan,
        }
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        return obj
