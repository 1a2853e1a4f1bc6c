"""--metrics: HOST:PORT parsing, a node's metrics from its events and its counters."""

import socket
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.node.control.timings import Timings
from fusionllm.node.observe.exporter import MetricsServer
from fusionllm.node.observe.listen import parse_listen, url_of
from fusionllm.node.observe.metrics import NodeMetrics
from fusionllm.node.observe.pulled import Sources
from fusionllm.node.pipeline.traffic import LinkTraffic


def _samples(metrics: NodeMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _step(step: int, loss: float, links=()) -> dict:
    return {"event": "step", "step": step, "loss": loss, "tokens_per_s": 512.0,
            "seconds": 0.3, "eval_loss": None, "links": list(links)}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:9100", ("127.0.0.1", 9100)), ("[::1]:0", ("::1", 0)),
     ("node.example:65535", ("node.example", 65535))],
)  # fmt: skip
def test_parse_listen_accepts_host_port(text, expected):
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [("9100", "not HOST:PORT"), (":9100", "not HOST:PORT"), ("host:", "port must be"),
     ("host:65536", "port must be"), ("host:-1", "port must be"), ("::1:9100", "brackets"),
     ("[nope]:1", "not an IPv6"), ("a b:1", "not a host"), ("x/y:1", "not a host")],
)  # fmt: skip
def test_parse_listen_refuses_with_the_reason(text, why):
    with pytest.raises(ConfigError, match=why):
        parse_listen(text)


def test_url_brackets_ipv6():
    assert url_of("::1", 80, "/metrics") == "http://[::1]:80/metrics"
    assert url_of("127.0.0.1", 80) == "http://127.0.0.1:80/"


def test_step_events_set_step_loss_and_add_link_bytes():
    metrics = NodeMetrics()
    link = {"link": 0, "kind": "activation", "codec": "tern", "frames": 4,
            "dense_bytes": 4000, "wire_bytes": 300}  # fmt: skip
    metrics.on_event(_step(0, 5.5, [link]))
    metrics.on_event(_step(1, 5.25, [{**link, "codec": "topk"}]))
    got = _samples(metrics)
    assert got[("fusionllm_step", ())] == 1
    assert got[("fusionllm_steps_total", ())] == 2
    assert got[("fusionllm_loss", ())] == 5.25
    assert got[("fusionllm_tokens_per_second", ())] == 512.0
    assert got[("fusionllm_step_seconds_count", ())] == 2
    labels = (("kind", "activation"), ("link", "0"))
    assert got[("fusionllm_link_dense_bytes_total", labels)] == 8000
    assert got[("fusionllm_link_wire_bytes_total", labels)] == 600
    assert got[("fusionllm_link_codec_info", (("codec", "topk"), *labels))] == 1
    assert ("fusionllm_link_codec_info", (("codec", "tern"), *labels)) not in got


def test_epoch_event_sets_members_and_the_plan_info():
    metrics = NodeMetrics()
    metrics.on_event({"event": "epoch", "epoch": 42, "digest": "ab" * 32,
                      "members": ["a", "b", "c"], "stages": [["a"], ["b"]],
                      "backup": ["c"]})  # fmt: skip
    got = _samples(metrics)
    assert got[("fusionllm_members", ())] == 3
    assert got[("fusionllm_plan_peers", ())] == 2
    assert got[("fusionllm_backup_peers", ())] == 1
    assert got[("fusionllm_plan_epoch", ())] == 42
    assert got[("fusionllm_plan_info", (("digest", "ab" * 32), ("epoch", "42")))] == 1


def test_a_malformed_event_is_skipped_not_raised(caplog):
    metrics = NodeMetrics()
    metrics.on_event({"event": "step", "step": 3})  # no loss, no seconds
    metrics.on_event({"event": "ready"})  # not a metric
    assert "could not read a step event" in caplog.text
    assert _samples(metrics)[("fusionllm_steps_total", ())] == 0


def test_refusals_dht_rounds_peers_and_checkpoint_age_are_read_at_scrape():
    now = [1000.0]
    metrics = NodeMetrics(clock=lambda: now[0])
    timings = Timings()
    timings.add("heartbeat", 0.25)
    timings.add("heartbeat", 0.75)
    health = {"skipped_records": 2, "gossip_dropped_invalid": 3, "proposals_not_members": 1,
              "invalid_proposals": 1, "plans_failed": 4}  # fmt: skip
    metrics.attach(Sources(
        health=lambda: health, transport_refusals=lambda: {"stream_not_admitted": 5,
                                                            "body_over_budget": 6},
        frames_refused=lambda: 7, timings=timings.snapshot, members=lambda: 3,
        connected=lambda: 1,
    ))  # fmt: skip
    metrics.on_event({"event": "checkpoint", "step": 20})
    now[0] += 12.5
    got = _samples(metrics)
    refused = {k[1]: v for k, v in got.items() if k[0] == "fusionllm_refused_total"}
    assert refused[(("reason", "stream_not_admitted"), ("what", "stream"))] == 5
    assert refused[(("reason", "body_over_budget"), ("what", "frame"))] == 6
    assert refused[(("reason", "outside_plan"), ("what", "frame"))] == 7
    assert refused[(("reason", "malformed"), ("what", "record"))] == 2
    assert refused[(("reason", "invalid"), ("what", "gossip"))] == 3
    assert refused[(("reason", "not_members"), ("what", "proposal"))] == 1
    assert got[("fusionllm_node_events_total", (("counter", "plans_failed"),))] == 4
    assert got[("fusionllm_dht_round_seconds_count", (("round", "heartbeat"),))] == 2
    assert got[("fusionllm_dht_round_seconds_sum", (("round", "heartbeat"),))] == 1.0
    assert got[("fusionllm_peers", (("seen_by", "dht_members"),))] == 3
    assert got[("fusionllm_checkpoint_age_seconds", ())] == 12.5
    assert got[("fusionllm_checkpoint_step", ())] == 20


def test_a_failing_source_reads_nothing_and_the_scrape_goes_on():
    metrics = NodeMetrics()

    def closed() -> dict:
        raise RuntimeError("transport closed")

    metrics.attach(Sources(transport_refusals=closed, members=lambda: 2))
    assert _samples(metrics)[("fusionllm_peers", (("seen_by", "dht_members"),))] == 2


def test_two_nodes_in_one_process_keep_their_own_registries():
    a, b = NodeMetrics(), NodeMetrics()
    a.on_event(_step(7, 1.0))
    assert _samples(a)[("fusionllm_step", ())] == 7
    assert _samples(b)[("fusionllm_step", ())] == 0


def test_the_server_serves_the_registry_and_refuses_a_taken_port():
    metrics = NodeMetrics()
    metrics.on_event(_step(3, 2.0))
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert "fusionllm_step 3.0" in body
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(FusionError, match=f"--metrics 127.0.0.1:{port}: cannot listen"):
            MetricsServer(NodeMetrics(), "127.0.0.1", port)
    finally:
        server.close()
    with socket.socket() as probe:  # closed: nothing listens there any more
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        probe.bind(("127.0.0.1", port))


def test_link_traffic_tallies_a_step_and_starts_over():
    traffic = LinkTraffic()
    traffic.add(link=1, kind="gradient", codec="topk", dense_bytes=100, wire_bytes=10)
    traffic.add(link=1, kind="gradient", codec="tern", dense_bytes=100, wire_bytes=12)
    traffic.add(link=0, kind="activation", codec="id", dense_bytes=50, wire_bytes=60)
    first = traffic.take()
    assert [t.to_json() for t in first] == [
        {"link": 0, "kind": "activation", "codec": "id", "frames": 1, "dense_bytes": 50,
         "wire_bytes": 60},
        {"link": 1, "kind": "gradient", "codec": "tern", "frames": 2, "dense_bytes": 200,
         "wire_bytes": 22},
    ]  # fmt: skip
    assert traffic.take() == ()
