"""UPnP port mapping's pure parts: the router's answers checked (port_map.py), the lease
schedule, PortMapper against a fake router, and ReachCheck trying it before relays."""

import argparse
import threading
import time

import pytest
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError
from fusionllm.dht.client import DhtConfig
from fusionllm.dht.records import NodeInfo
from fusionllm.node.cli.announce_options import add_announce_options, announce_fields
from fusionllm.node.control.port_mapper import RETRY_S, PortMapper
from fusionllm.node.control.reach_check import ReachCheck, ReachConfig
from fusionllm.node.p2p.dialback import DialBackAnswer, DialBackConfig
from fusionllm.node.p2p.port_map import (
    GatewayError,
    PortMapConfig,
    PortMapping,
    check_entry,
    check_external_ip,
    check_internal_ip,
    check_lease,
    check_port,
    due,
    renew_at,
)
from fusionllm.node.p2p.reachability import explain
from fusionllm.node.p2p.upnp import bounded
from tests.unit.test_epochs import record

QUICK = ReachConfig(dialback=DialBackConfig(min_interval_s=0.01))  # no wait to ask again
PUBLIC = "203.0.114.7"  # global (just outside TEST-NET-3)
LAN = "192.168.1.2"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("192.168.1.1", "not a public IPv4"),  # a router behind another router
        ("10.0.0.1", "not a public IPv4"),
        ("100.64.3.4", "not a public IPv4"),  # carrier-grade NAT's shared space
        ("0.0.0.0", "not a public IPv4"),  # a router that has no WAN address yet
        ("127.0.0.1", "not a public IPv4"),
        ("224.0.0.1", "not a public IPv4"),
        ("2001:4860::1", "not a public IPv4"),
        ("", "not an address"),
        ("1.2.3.4.5", "not an address"),
        (None, "not an address"),
        ("9" * 100, "not an address"),
    ],
)
def test_an_external_address_peers_cannot_dial_is_refused(text, why):
    with pytest.raises(GatewayError, match=why):
        check_external_ip(text)


def test_a_public_external_address_is_taken():
    assert check_external_ip(PUBLIC) == PUBLIC
    assert check_internal_ip(LAN) == LAN
    for bad in ("8.8.8.8", "127.0.0.1", "0.0.0.0", "nonsense", None):
        with pytest.raises(GatewayError, match="LAN address"):
            check_internal_ip(bad)


@pytest.mark.parametrize("port", [0, -1, 65536, 1 << 40, True, "4001", 4001.0, None])
def test_a_port_out_of_range_is_refused(port):
    with pytest.raises(GatewayError, match="out of range"):
        check_port(port)


def test_the_routers_entry_must_be_the_mapping_asked_for():
    asked = dict(port=4001, internal_ip=LAN, asked_s=3600)
    assert check_entry((LAN, 4001, "fusionllm", True, 3599), **asked) == 3599
    assert check_entry((LAN, 4001, "fusionllm", True, 0), **asked) == 3600  # "for ever"
    lies = {
        None: "lists no such mapping",
        (LAN, 4001, "x", True): "malformed",
        "a string": "malformed",
        ("192.168.1.9", 4001, "x", True, 3600): "not to 192.168.1.2:4001",  # someone else
        (LAN, 4002, "x", True, 3600): "not to",
        (LAN, 4001, "x", False, 3600): "enabled False",
        (LAN, 4001, "x", True, 10**9): "outside",  # more than asked
        (LAN, 4001, "x", True, 5): "outside",  # we would renew all the time
        (LAN, 4001, "x", True, -1): "outside",
        (LAN, 4001, "x", True, "3600"): "not a number",
    }
    for entry, why in lies.items():
        with pytest.raises(GatewayError, match=why):
            check_entry(entry, **asked)
    with pytest.raises(GatewayError, match="not a number"):
        check_lease(True, 3600)


def test_a_lease_is_renewed_half_way_and_only_the_due_ones():
    assert renew_at(100.0, 3600, 0.5) == 1900.0
    with pytest.raises(ValueError, match="fraction"):
        renew_at(0.0, 3600, 1.0)
    maps = {
        p: PortMapping(port=p, external_ip=PUBLIC, internal_ip=LAN, lease_s=lease, granted_at=t)
        for p, lease, t in ((4001, 3600, 0.0), (4002, 120, 0.0), (4003, 3600, 1000.0))
    }
    assert due(maps, 59.0, 0.5) == []
    assert due(maps, 60.0, 0.5) == [4002]
    assert due(maps, 1800.0, 0.5) == [4001, 4002]
    assert due(maps, 2800.0, 0.5) == [4001, 4002, 4003]


def test_the_config_is_checked():
    PortMapConfig(enabled=False)
    for bad, why in (
        (dict(discover_s=0), "discover_s"),
        (dict(discover_s=60), "discover_s"),
        (dict(lease_s=10), "lease_s"),
        (dict(lease_s=3600.0), "lease_s"),
        (dict(renew_fraction=1.0), "renew_fraction"),
        (dict(description=""), "description"),
        (dict(enabled="yes"), "enabled"),
    ):
        with pytest.raises(ConfigError, match=why):
            PortMapConfig(**bad)


def test_no_upnp_turns_it_off():
    parser = argparse.ArgumentParser()
    add_announce_options(parser)
    assert announce_fields(parser.parse_args([]))["upnp"] is True
    assert announce_fields(parser.parse_args(["--no-upnp"]))["upnp"] is False


# ----- PortMapper against a fake router -------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRouter:
    """A router that grants ``lease_s``; ``refuse`` names ports it will not map."""

    def __init__(self, clock, external_ip=PUBLIC, lease_s=600, refuse=()) -> None:
        self.clock, self.external_ip, self.lease_s = clock, external_ip, lease_s
        self.refuse = set(refuse)
        self.table: dict[int, float] = {}  # port -> when (re)mapped
        self.removed: list[int] = []
        self.finds = 0

    def find(self, config, clock):
        self.finds += 1
        return self

    def map(self, port: int) -> PortMapping:
        if port in self.refuse:
            raise GatewayError(f"mapping port {port}: ConflictInMappingEntry")
        self.table[port] = self.clock()
        return PortMapping(port=port, external_ip=self.external_ip, internal_ip=LAN,
                           lease_s=self.lease_s, granted_at=self.clock())  # fmt: skip

    def unmap(self, port: int) -> None:
        if self.table.pop(port, None) is None:
            raise GatewayError(f"removing port {port}: NoSuchEntryInArray")
        self.removed.append(port)


def _mapper(router, clock, **config):
    return PortMapper(PortMapConfig(**config), find_gateway=router.find, clock=clock)


def test_ports_are_mapped_renewed_at_half_their_lease_and_removed_on_close():
    clock = FakeClock()
    router = FakeRouter(clock)
    mapper = _mapper(router, clock)
    assert mapper.open([4001, 4002, 4001], observed_ips=[PUBLIC])
    assert sorted(router.table) == [4001, 4002]
    assert mapper.mapped
    clock.now = 299.0
    mapper.renew()
    assert router.table == {4001: 0.0, 4002: 0.0}  # not due yet
    clock.now = 300.0
    mapper.renew()
    assert router.table == {4001: 300.0, 4002: 300.0}
    mapper.close()
    assert router.table == {}
    assert sorted(router.removed) == [4001, 4002]
    assert not mapper.mapped


def test_a_router_that_names_another_address_than_members_see_keeps_no_mapping():
    clock = FakeClock()
    router = FakeRouter(clock, external_ip="203.0.114.99")
    mapper = _mapper(router, clock)
    assert not mapper.open([4001], observed_ips=[PUBLIC])
    assert router.table == {}
    assert not mapper.mapped
    assert not mapper.worth_trying()  # not again at once
    clock.now = RETRY_S
    assert mapper.worth_trying()


def test_a_refused_port_undoes_the_others_and_a_failed_renewal_drops_all():
    clock = FakeClock()
    router = FakeRouter(clock, refuse={4002})
    mapper = _mapper(router, clock)
    assert not mapper.open([4001, 4002], observed_ips=[PUBLIC])
    assert router.table == {}
    assert router.removed == [4001]
    router.refuse.clear()
    clock.now = RETRY_S
    assert mapper.open([4001, 4002], observed_ips=[])
    router.refuse.add(4001)
    clock.now += 300
    mapper.renew()
    assert router.table == {}
    assert not mapper.mapped


def test_disabled_never_tries():
    assert not _mapper(FakeRouter(FakeClock()), FakeClock(), enabled=False).worth_trying()


# ----- ReachCheck: private, then mapped ---------------------------------------------------------


class MappingHost:
    """Members answer dial-backs: blind until the router maps ``port``."""

    def __init__(self, router: FakeRouter, members: list[str], port: int = 4001) -> None:
        self.peer_id, self.libp2p = "QmSelf", None
        self.router, self.members, self.port = router, members, port
        self.bound_addrs = [f"/ip4/{LAN}/tcp/{port}"]

    def connected_peers(self) -> list[str]:
        return self.members

    def call(self, fn, libp2p, peer, ports, config):
        reached = {p: p in self.router.table for p in ports}
        return DialBackAnswer(peer=peer.to_base58(), observed_ip=PUBLIC, reached=reached)


def _members() -> dict[str, NodeInfo]:
    ids = [ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(2)]
    return {
        p: record(p, addrs=(f"/ip4/203.0.114.{i}/tcp/1/p2p/{p}",), reach="public")
        for i, p in enumerate(ids, 1)
    }  # fmt: skip


def test_a_private_node_maps_its_ports_and_members_then_reach_it_mapped():
    clock = FakeClock()
    router = FakeRouter(clock)
    members = _members()
    events = []
    check = ReachCheck(
        host=MappingHost(router, list(members)), config=QUICK, members=lambda: members,
        is_member=lambda p: True, listen_ips=[LAN], mapper=_mapper(router, clock),
        mapped_ports=lambda: [5001], emit=lambda kind, **f: events.append(f),
    )  # fmt: skip
    verdict = check.check_once()
    assert verdict.verdict == "mapped"
    assert verdict.addrs == (f"{PUBLIC}:4001",)
    assert sorted(router.table) == [4001, 5001]  # the host's port and the lanes'
    assert events[-1]["upnp"] is True
    assert events[-1]["verdict"] == "mapped"
    assert "asked over UPnP" in explain("mapped", verdict.addrs, upnp=True)
    listen = [f"/ip4/{LAN}/tcp/4001/p2p/QmSelf"]
    assert check.advertised(listen) == [f"/ip4/{PUBLIC}/tcp/4001/p2p/QmSelf", *listen]
    check.close()
    assert router.table == {}


def _fixed_answers(observed_ip: str, reached: bool) -> tuple[ReachCheck, FakeRouter]:
    """A check whose members answer the same whatever the router does."""
    clock = FakeClock()
    router = FakeRouter(clock)
    members = _members()
    host = MappingHost(router, list(members))
    host.call = lambda fn, libp2p, peer, ports, config: DialBackAnswer(
        peer=peer.to_base58(), observed_ip=observed_ip, reached={p: reached for p in ports}
    )
    check = ReachCheck(host=host, config=QUICK, members=lambda: members,
                       is_member=lambda p: True, listen_ips=[LAN],
                       mapper=_mapper(router, clock))  # fmt: skip
    return check, router


def test_a_mapping_members_still_cannot_dial_is_removed_and_the_node_stays_private():
    check, router = _fixed_answers(PUBLIC, False)  # a router that says yes, forwards nothing
    assert check.check_once().verdict == "private"
    assert router.table == {}
    assert router.removed == [4001]
    assert router.finds == 1
    check.check_once()
    assert router.finds == 1  # not asked again before RETRY_S


def test_a_public_node_never_asks_its_router():
    check, router = _fixed_answers(LAN, True)  # reached where it listens
    assert check.check_once().verdict == "public"
    assert router.finds == 0


def test_a_router_that_never_answers_costs_the_deadline_only():
    started = time.monotonic()
    with pytest.raises(GatewayError, match=r"no answer within 0\.1 s"):
        bounded(lambda: threading.Event().wait(5), 0.1, "discovery")
    assert time.monotonic() - started < 2  # not the call's 5 s
    with pytest.raises(GatewayError, match="mapping port 4001: ConflictInMappingEntry"):
        bounded(_conflict, 1.0, "mapping port 4001")
    assert bounded(lambda: 7, 1.0, "x") == 7


def _conflict():
    raise Exception("ConflictInMappingEntry")  # what miniupnpc raises


def test_the_dht_daemon_maps_nothing_when_told_not_to():
    assert DhtConfig(swarm="s").worker_config()["nat_port_map"] is True
    assert DhtConfig(swarm="s", nat_port_map=False).worker_config()["nat_port_map"] is False


def test_mappings_the_router_lost_are_dropped_and_asked_for_again_later():
    clock = FakeClock()
    router = FakeRouter(clock)
    members = _members()
    check = ReachCheck(host=MappingHost(router, list(members)), config=QUICK,
                       members=lambda: members, is_member=lambda p: True, listen_ips=[LAN],
                       mapper=_mapper(router, clock))  # fmt: skip
    assert check.check_once().verdict == "mapped"
    router.table.clear()  # the router rebooted
    clock.now = 10.0
    assert check.check_once().verdict == "private"
    assert check.advertised([]) == []  # the router's address is named no more
    clock.now = RETRY_S
    assert check.check_once().verdict == "mapped"
    assert router.finds == 2
