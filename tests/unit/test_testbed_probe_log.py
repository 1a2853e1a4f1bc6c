"""benchmarks/testbed_probe_log.py: a node log's bulk-probe lines read back, as the node
writes them (senders.py's format, bulk_figure.samples_text)."""

import json
import logging

import pytest

from benchmarks.testbed_probe_log import parse_probe_line, run_report
from fusionllm.node.p2p.lane.bulk_figure import samples_text

PEER = "12D3KooWFf7nGRdoF5VysN1wUEVxPkTZozq5ZVeMg4VmXM3urTX5"


def _line(figure: float, samples: tuple[float, ...]) -> str:
    # The node's own format string (senders.py), through logging's formatting.
    record = logging.LogRecord(
        "fusionllm.node.p2p.lane.senders", logging.INFO, __file__, 0,
        "bulk probe to %s: %.3g MB/s, rtt %.1f ms, from %d bytes; samples (MB/s, "
        "* in slow start) %s", (PEER, figure / 1e6, 40.2, 4194902, samples_text(samples)), None,
    )  # fmt: skip
    return "00:20:54 I fusionllm.node.p2p.lane.senders: " + record.getMessage()


def test_a_probe_line_is_read_back_as_the_node_wrote_it():
    probe = parse_probe_line(_line(12.1e6, (-1.67e6, -12.1e6, -14.5e6, 11e6)))
    assert probe.peer == PEER
    assert probe.figure == 12.1
    assert probe.samples == (1.67, 12.1, 14.5, 11.0)
    assert probe.slow_start == (True, True, True, False)
    assert probe.every_sample_figure == 12.1
    assert parse_probe_line("00:20:54 I fusionllm.node.control.epochs: epoch 1: adopted") is None
    assert parse_probe_line(_line(1e6, (1e6,)).replace("1 MB/s", "x MB/s")) is None


@pytest.mark.parametrize("figure", [12.1e6, 14.5e6])
def test_a_runs_report_names_the_probes_over_the_cap_and_the_ones_the_rule_moved(tmp_path, figure):
    samples = (-12.1e6,) * 8 + (-14.5e6, -14.5e6, 11e6)
    (tmp_path / "h1.log").write_text("\n".join(["start", _line(figure, samples), "end"]))
    (tmp_path / "h3.events.jsonl").write_text(json.dumps({"event": "ready", "peer_id": PEER}))
    report = run_report(tmp_path, {("h1", "h3"): 12.5})
    assert report[0] == "1 probes"
    assert any(r.startswith("  over: h1>h3 cap 12.5 figure") for r in report)  # a sample is
    moved = [r for r in report if "moved by the queue-climb rule" in r]
    assert moved == (["  moved by the queue-climb rule: h1>h3 14.5 (1.16) -> 12.1 (0.97)"]
                     if figure == 12.1e6 else [])  # fmt: skip
