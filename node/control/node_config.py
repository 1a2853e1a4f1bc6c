"""How one node runs: its key, addresses, probing and device (validated), and this machine.

The swarm-wide part (what every node must share) is ``SwarmSettings``; this is the rest.
"""

import functools
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from fusionllm.common.errors import ConfigError
from fusionllm.common.swarm_key import SwarmKey
from fusionllm.dht.records import DeviceInfo
from fusionllm.node.control.swarm_settings import SwarmSettings
from fusionllm.node.p2p.announce import AnnounceAddr, announced_multiaddrs
from fusionllm.node.p2p.checks import boolean, int_in
from fusionllm.node.p2p.control_host import ControlConfig
from fusionllm.node.p2p.peer_host import HostConfig

if TYPE_CHECKING:
    from fusionllm.node.p2p.transport_types import TransportConfig


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    settings: SwarmSettings = field(default_factory=SwarmSettings)
    key_path: Path
    bootstrap: tuple[str, ...] = ()  # DHT multiaddrs of any node already in the swarm
    listen_host: str = "127.0.0.1"
    dht_port: int = 0
    control_port: int = 0  # the node's one py-libp2p host: control and data planes
    lanes: bool = True  # tensor frames over lanes (p2p/lane/) where the peer offers one
    lane_port: int = 0  # where this node accepts lanes; 0: a free port
    # Where peers reach this node when that is not where it listens (p2p/announce.py): the
    # host's addresses (a port each, or the bound one), and the DHT's and lanes' ports there.
    announce: tuple[AnnounceAddr, ...] = ()
    announce_dht_port: int = 0  # 0: dht_port
    announce_lane_port: int = 0  # 0: the port lanes bound
    upnp: bool = True  # a private node asks its router to map its ports (port_mapper.py)
    # A private swarm's key (--swarm-key): host connections need it, records carry its tag.
    # Its digest must be settings.key_digest, so the key also names the swarm's settings.
    swarm_key: SwarmKey | None = None
    probe_interval_s: float = 10.0
    probe_fanout: int = 3  # peers probed per interval
    probe_bytes: int = 1 << 20  # its range is ControlConfig's (up to max_probe_bytes)
    max_connections: int = 32
    device: DeviceInfo | None = None  # None: measure this machine (cached, node/probe.py)
    device_cache: Path | None = None
    compute_device: str = "auto"  # what the probe measures: where our stages will train
    compute_threads: int = 0  # torch's threads for compute (0: torch's choice)
    rehearse_s: float = 0.0  # a rehearsal of the run's first stage at start (rehearsal.py)
    uplink: float | None = None  # bytes/s; None: our best measurement
    downlink: float | None = None
    dht_log_level: str = "WARNING"
    observer: bool = False  # trains nothing, says so in its record: never seated in a plan

    @property
    def maps_ports(self) -> bool:
        """Whether this node may ask its router (and lets p2pd ask) to map ports over UPnP:
        never behind --announce-addr, which names the forward already made."""
        return self.upnp and not self.announce

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_path", Path(self.key_path))
        object.__setattr__(self, "bootstrap", tuple(self.bootstrap))
        if not self.probe_interval_s > 0:
            raise ConfigError(f"probe_interval_s must be > 0, got {self.probe_interval_s}")
        if not 0 <= self.probe_fanout <= 64:
            raise ConfigError(f"probe_fanout must be in [0, 64], got {self.probe_fanout}")
        for name in ("uplink", "downlink"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 bytes/s, got {value}")
        # The host and the control plane check their own fields (address, port, probe sizes);
        # building their configs here makes a bad value a ConfigError now, not at start().
        self.control_config()
        if not 0 <= self.rehearse_s <= 60:
            raise ConfigError(f"rehearse_s must be in [0, 60] s, got {self.rehearse_s}")
        int_in("compute_threads", self.compute_threads, 0, 4096)
        boolean("lanes", self.lanes)
        boolean("observer", self.observer)
        boolean("upnp", self.upnp)
        int_in("lane_port", self.lane_port, 0, 65535)
        int_in("announce_dht_port", self.announce_dht_port, 0, 65535)
        int_in("announce_lane_port", self.announce_lane_port, 0, 65535)
        object.__setattr__(self, "announce", tuple(self.announce))
        expected = self.swarm_key.digest if self.swarm_key is not None else ""
        if self.settings.key_digest != expected:
            raise ConfigError(
                f"settings.key_digest {self.settings.key_digest!r} is not the swarm key's "
                f"digest {expected!r}"
            )
        self.host_config()  # checks the announced addresses
        if self.announce and not (self.announce_dht_port or self.dht_port):
            # hivemind announces a fixed port only: the one a forward or firewall opens.
            raise ConfigError("announced addresses need a fixed dht_port (or announce_dht_port)")

    def transport_config(self) -> "TransportConfig":
        """The data plane on the node's host (its address and port rule; lanes are ours)."""
        # Here, not at the top: the data plane's types import torch, and a node that trains
        # nothing never loads it (README: lighter node).
        from fusionllm.node.p2p.transport_types import TransportConfig

        return TransportConfig(
            key_path=self.key_path,
            listen_host=self.listen_host,
            close_timeout_s=2.0,
            lanes=self.lanes,
            lane_port=self.lane_port,
            lane_announce_port=self.announce_lane_port,
        )

    def control_config(self) -> ControlConfig:
        return ControlConfig(
            key_path=self.key_path,
            listen_host=self.listen_host,
            listen_port=self.control_port,
            probe_bytes=self.probe_bytes,
        )

    def host_config(self) -> HostConfig:
        """The node's one py-libp2p host: the control plane's listen address and deadlines."""
        return replace(
            self.control_config().host_config(), announce=self.announce, swarm_key=self.swarm_key
        )

    def dht_announce_maddrs(self) -> tuple[str, ...]:
        """What the DHT announces: each announced IP at the DHT's announced port."""
        hosts = [replace(a, port=None) for a in self.announce]
        return announced_multiaddrs(hosts, self.announce_dht_port or self.dht_port)


@functools.cache  # read on every heartbeat; importlib.metadata scans sys.path each time
def software_version() -> str:
    try:
        return metadata.version("fusionllm")
    except metadata.PackageNotFoundError:
        return "unknown"
