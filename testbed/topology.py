"""Topologies: hosts (compute share, uplink, downlink) and the links between every pair.

A topology file is TOML (or JSON of the same shape)::

    name = "B"
    description = "two sites, 1 Gbit/s inside, 20 Mbit/s and 25 ms between"

    [defaults]            # every pair not named below (all optional)
    delay_ms = 0.25       # one way: a round trip is twice this
    rate_mbps = 1000      # per direction; omit for no cap
    loss = 0.0            # probability a packet is dropped on the link
    queue_ms = 100        # drop-tail queue of every FIFO, in time at its rate

    [[hosts]]
    name = "a1"
    site = "east"         # optional; links may name sites
    cpu = 0.5             # cores (a cgroup v1 CPU quota); omit for no limit
    uplink_mbps = 1000    # omit for no cap
    downlink_mbps = 1000
    nat = "cone"          # optional: the host is a home behind a router ("cone" or
                          # "symmetric", see testbed/nat.py); the links above are the router's

    [[links]]             # later entries override earlier ones; both directions
    sites = ["east", "west"]   # every pair across these sites (or: hosts = ["a1", "b1"])
    delay_ms = 12.5
    rate_mbps = 20

``load_topology`` parses and validates; everything here is pure.
"""

import json
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from itertools import combinations
from pathlib import Path
from typing import Any

from fusionllm.testbed.errors import TopologyError
from fusionllm.testbed.nat import NAT_KINDS

MAX_HOSTS = 64
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")
_MAX_NAME = 8  # host names become parts of interface, namespace and cgroup names
_MAX_RATE_MBPS = 100_000.0
_MAX_DELAY_MS = 10_000.0
_DEFAULT_QUEUE_MS = 100.0
# A FIFO must hold at least one whole GSO segment (64 KiB) or a slow link drops every one.
MIN_QUEUE_BYTES = 2 * 65536


def _check_rate(what: str, value: float | None) -> None:
    if value is not None and not (0 < value <= _MAX_RATE_MBPS):
        raise TopologyError(f"{what}: rate {value} Mbit/s not in (0, {_MAX_RATE_MBPS}]")


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One direction of the path between two hosts, besides their uplink and downlink."""

    delay_ms: float = 0.0
    rate_mbps: float | None = None
    loss: float = 0.0
    queue_ms: float = _DEFAULT_QUEUE_MS

    def __post_init__(self) -> None:
        if not (0 <= self.delay_ms <= _MAX_DELAY_MS) or math.isnan(self.delay_ms):
            raise TopologyError(f"delay_ms {self.delay_ms} not in [0, {_MAX_DELAY_MS}]")
        _check_rate("link", self.rate_mbps)
        if not (0 <= self.loss < 1):
            raise TopologyError(f"loss {self.loss} not in [0, 1)")
        if not (0 < self.queue_ms <= _MAX_DELAY_MS):
            raise TopologyError(f"queue_ms {self.queue_ms} not in (0, {_MAX_DELAY_MS}]")


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    name: str
    site: str = ""
    cpu: float | None = None  # cores
    uplink_mbps: float | None = None
    downlink_mbps: float | None = None
    nat: str | None = None  # a home behind a router of this kind (NAT_KINDS)

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > _MAX_NAME or not set(self.name) <= _NAME_CHARS:
            raise TopologyError(
                f"host name {self.name!r}: 1-{_MAX_NAME} of lowercase letters, digits, '-'"
            )
        # 0.1 core at least: the kernel's smallest quota is 1 ms, and cgroups.PERIOD_US is 10 ms
        if self.cpu is not None and not (0.1 <= self.cpu <= 1024):
            raise TopologyError(f"host {self.name}: cpu {self.cpu} cores not in [0.1, 1024]")
        _check_rate(f"host {self.name} uplink", self.uplink_mbps)
        _check_rate(f"host {self.name} downlink", self.downlink_mbps)
        if self.nat is not None and self.nat not in NAT_KINDS:
            raise TopologyError(f"host {self.name}: nat {self.nat!r} not one of {NAT_KINDS}")


@dataclass(frozen=True, kw_only=True)
class Topology:
    name: str
    hosts: tuple[HostSpec, ...]
    links: dict[tuple[str, str], LinkSpec] = field(repr=False)  # (src, dst) -> spec
    description: str = ""
    queue_ms: float = _DEFAULT_QUEUE_MS  # the hosts' uplink and downlink FIFOs

    def __post_init__(self) -> None:
        names = [h.name for h in self.hosts]
        if not (1 <= len(names) <= MAX_HOSTS):
            raise TopologyError(f"topology {self.name}: {len(names)} hosts, want 1-{MAX_HOSTS}")
        if len(set(names)) != len(names):
            raise TopologyError(f"topology {self.name}: duplicate host names in {names}")
        pairs = {(a, b) for a in names for b in names if a != b}
        if set(self.links) != pairs:
            raise TopologyError(f"topology {self.name}: links must cover every ordered pair")

    def host(self, name: str) -> HostSpec:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def link(self, src: str, dst: str) -> LinkSpec:
        return self.links[(src, dst)]

    def path_rate_mbps(self, src: str, dst: str) -> float | None:
        """The slowest cap on the way from ``src`` to ``dst`` (None: uncapped)."""
        rates = [
            self.host(src).uplink_mbps,
            self.link(src, dst).rate_mbps,
            self.host(dst).downlink_mbps,
        ]
        capped = [r for r in rates if r is not None]
        return min(capped) if capped else None

    def rtt_ms(self, a: str, b: str) -> float:
        return self.link(a, b).delay_ms + self.link(b, a).delay_ms


def queue_bytes(rate_mbps: float | None, queue_ms: float) -> int:
    """A FIFO's drop-tail limit: ``queue_ms`` at its rate, never under one GSO burst."""
    if rate_mbps is None:
        return MIN_QUEUE_BYTES
    return max(MIN_QUEUE_BYTES, int(rate_mbps * 125 * queue_ms))  # Mbit/s * ms = 125 B


_LINK_KEYS = {"delay_ms", "rate_mbps", "loss", "queue_ms"}
_HOST_KEYS = {"name", "site", "cpu", "uplink_mbps", "downlink_mbps", "nat"}


def _table(value: Any, what: str, allowed: set[str]) -> dict:
    if not isinstance(value, dict):
        raise TopologyError(f"{what}: expected a table, got {type(value).__name__}")
    unknown = set(value) - allowed
    if unknown:
        raise TopologyError(f"{what}: unknown keys {sorted(unknown)} (known: {sorted(allowed)})")
    return value


def _link_fields(table: dict, what: str) -> dict:
    fields = {k: table[k] for k in _LINK_KEYS if k in table}
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TopologyError(f"{what}: {key} must be a number, got {value!r}")
    return fields


def _pairs_of(entry: dict, hosts: tuple[HostSpec, ...], what: str) -> list[tuple[str, str]]:
    """The unordered host pairs a [[links]] entry names, by ``hosts`` or by ``sites``."""
    if ("hosts" in entry) == ("sites" in entry):
        raise TopologyError(f"{what}: name exactly one of 'hosts' or 'sites'")
    key = "hosts" if "hosts" in entry else "sites"
    named = entry[key]
    if not isinstance(named, list) or len(named) != 2 or not all(isinstance(n, str) for n in named):
        raise TopologyError(f"{what}: {key} must be a list of two names, got {named!r}")
    if key == "hosts":
        known = {h.name for h in hosts}
        if not set(named) <= known or named[0] == named[1]:
            raise TopologyError(f"{what}: hosts {named} must be two of {sorted(known)}")
        return [(named[0], named[1])]
    groups = [[h.name for h in hosts if h.site == site] for site in named]
    if not all(groups):
        raise TopologyError(f"{what}: site {named} has no hosts")
    same = named[0] == named[1]
    if same:
        return list(combinations(groups[0], 2))
    return [(a, b) for a in groups[0] for b in groups[1]]


def parse_topology(data: Any, *, source: str = "topology") -> Topology:
    """A validated ``Topology`` from the parsed file (TopologyError naming what is wrong)."""
    top = _table(data, source, {"name", "description", "defaults", "hosts", "links"})
    defaults = _link_fields(
        _table(top.get("defaults", {}), f"{source} defaults", _LINK_KEYS), source
    )
    raw_hosts = top.get("hosts")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise TopologyError(f"{source}: needs a non-empty [[hosts]] list")
    try:
        hosts = tuple(
            HostSpec(**_table(h, f"{source} host #{i}", _HOST_KEYS))
            for i, h in enumerate(raw_hosts)
        )
        base = LinkSpec(**defaults)
    except TypeError as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    per_pair: dict[tuple[str, str], dict] = {}
    raw_links = top.get("links", [])
    if not isinstance(raw_links, list):
        raise TopologyError(f"{source}: links must be a list of tables")
    for i, raw in enumerate(raw_links):
        what = f"{source} link #{i}"
        entry = _table(raw, what, _LINK_KEYS | {"hosts", "sites"})
        fields = _link_fields(entry, what)
        for a, b in _pairs_of(entry, hosts, what):
            per_pair.setdefault((a, b), {}).update(fields)
            per_pair.setdefault((b, a), {}).update(fields)
    names = [h.name for h in hosts]
    links = {
        (a, b): LinkSpec(**{**defaults, **per_pair.get((a, b), {})}) if (a, b) in per_pair else base
        for a in names
        for b in names
        if a != b
    }
    name = top.get("name", source)
    if not isinstance(name, str) or not name:
        raise TopologyError(f"{source}: name must be a non-empty string")
    return Topology(
        name=name,
        description=str(top.get("description", "")),
        hosts=hosts,
        links=links,
        queue_ms=base.queue_ms,
    )


SHIPPED = ("A", "B", "C", "mini", "homes")


def load_topology(name_or_path: str | Path) -> Topology:
    """A shipped topology by name (``SHIPPED``) or a .toml/.json file."""
    if str(name_or_path) in SHIPPED:
        ref = resources.files("fusionllm.testbed").joinpath(f"topologies/{name_or_path}.toml")
        text, source = ref.read_text(), f"topology {name_or_path}"
    else:
        path = Path(name_or_path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise TopologyError(f"topology file {path}: {exc.strerror}") from exc
        source = str(path)
    try:
        data = json.loads(text) if source.endswith(".json") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    return parse_topology(data, source=source)
