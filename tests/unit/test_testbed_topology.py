"""Topology files: parsing, defaults and overrides, refusals, the shipped topologies."""

import json

import pytest

from fusionllm.testbed.topology import (
    MIN_QUEUE_BYTES,
    SHIPPED,
    TopologyError,
    load_topology,
    parse_topology,
    queue_bytes,
)


def _two_sites() -> dict:
    return {
        "name": "t",
        "defaults": {"delay_ms": 0.5, "rate_mbps": 1000},
        "hosts": [
            {"name": "e1", "site": "east", "cpu": 0.5, "uplink_mbps": 100},
            {"name": "e2", "site": "east"},
            {"name": "w1", "site": "west", "downlink_mbps": 50},
        ],
        "links": [
            {"sites": ["east", "west"], "delay_ms": 12.5, "rate_mbps": 20},
            {"hosts": ["e2", "w1"], "loss": 0.01},
        ],
    }


def test_links_take_defaults_then_entries_in_order_both_ways():
    topo = parse_topology(_two_sites())
    assert topo.link("e1", "e2").delay_ms == 0.5
    assert topo.link("e1", "e2").rate_mbps == 1000
    assert topo.link("w1", "e1").delay_ms == 12.5
    assert topo.link("e1", "w1").rate_mbps == 20
    later = topo.link("w1", "e2")  # the second entry overrides only what it names
    assert (later.delay_ms, later.rate_mbps, later.loss) == (12.5, 20, 0.01)
    assert topo.link("e1", "w1").loss == 0.0
    assert topo.rtt_ms("e1", "w1") == 25.0


def test_path_rate_is_the_slowest_cap_on_the_way():
    topo = parse_topology(_two_sites())
    assert topo.path_rate_mbps("e1", "e2") == 100  # e1's uplink
    assert topo.path_rate_mbps("e2", "e1") == 1000
    assert topo.path_rate_mbps("e1", "w1") == 20
    no_caps = parse_topology({"hosts": [{"name": "a"}, {"name": "b"}]})
    assert no_caps.path_rate_mbps("a", "b") is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["hosts"].append({"name": "e1"}), "duplicate host"),
        (lambda d: d["hosts"][0].update(name="E1"), "host name"),
        (lambda d: d["hosts"][0].update(name="toolonghost"), "host name"),
        (lambda d: d["hosts"][0].update(cpu=0), "cpu 0 cores"),
        (lambda d: d["hosts"][0].update(cpu=0.05), r"cpu 0.05 cores not in \[0.1,"),  # < 1 ms
        (lambda d: d["hosts"][0].update(gpu=1), r"unknown keys \['gpu'\]"),
        (lambda d: d["hosts"][1].update(uplink_mbps=-5), "rate -5"),
        (lambda d: d["links"][0].update(loss=1.0), "loss 1.0"),
        (lambda d: d["links"][0].update(delay_ms=float("nan")), "delay_ms nan"),
        (lambda d: d["links"][0].update(rate_mbps="fast"), "rate_mbps must be a number"),
        (lambda d: d["links"][0].update(hosts=["e1", "w1"]), "exactly one of"),
        (lambda d: d["links"][1].update(hosts=["e2", "x9"]), "must be two of"),
        (lambda d: d["links"][0].update(sites=["east", "north"]), "has no hosts"),
        (lambda d: d.update(hosts=[]), "non-empty"),
        (lambda d: d.update(links={"a": 1}), "links must be a list"),
    ],
)
def test_a_bad_topology_is_refused_with_what_is_wrong(change, match):
    data = _two_sites()
    change(data)
    with pytest.raises(TopologyError, match=match):
        parse_topology(data)


def test_a_site_with_itself_names_every_pair_inside_it():
    data = _two_sites()
    data["links"] = [{"sites": ["east", "east"], "delay_ms": 2}]
    topo = parse_topology(data)
    assert topo.link("e2", "e1").delay_ms == 2
    assert topo.link("e1", "w1").delay_ms == 0.5


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_topologies_load(name):
    topo = load_topology(name)
    assert 3 <= len(topo.hosts) <= 6
    assert topo.description


def test_shipped_topologies_are_what_the_issue_asks_for():
    a, b, c = (load_topology(n) for n in "ABC")
    assert {a.rtt_ms(x.name, y.name) for x in a.hosts for y in a.hosts if x != y} == {0.5}
    assert b.path_rate_mbps("e1", "w1") == 20 and b.rtt_ms("e1", "w1") == 25  # noqa: PT018
    assert b.path_rate_mbps("e1", "e2") == 1000
    ups = sorted(h.uplink_mbps for h in c.hosts)
    assert ups[0] == 8 and ups[-1] == 100  # noqa: PT018
    assert all(h.downlink_mbps == 5 * h.uplink_mbps for h in c.hosts)
    rtts = {c.rtt_ms(x.name, y.name) for x in c.hosts for y in c.hosts if x != y}
    assert min(rtts) == 10 and max(rtts) == 80  # noqa: PT018
    assert max(h.cpu for h in c.hosts) / min(h.cpu for h in c.hosts) == 4


def test_a_json_file_loads_like_toml(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_two_sites()))
    assert load_topology(path).link("e1", "w1").rate_mbps == 20
    with pytest.raises(TopologyError, match="No such file"):
        load_topology(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = ")
    with pytest.raises(TopologyError, match=r"bad\.toml"):
        load_topology(bad)


def test_a_queue_holds_its_time_at_rate_and_never_less_than_two_gso_bursts():
    assert queue_bytes(100, 100) == 1_250_000  # 100 Mbit/s for 100 ms
    assert queue_bytes(8, 10) == MIN_QUEUE_BYTES
    assert queue_bytes(None, 100) == MIN_QUEUE_BYTES
