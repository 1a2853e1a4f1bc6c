"""The facts child: the node plans from its costs and device without importing torch itself."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from fusionllm.common.run_spec import STDLIB_VOCAB
from fusionllm.dag import trace
from fusionllm.dag.graph import costs_from_json, costs_to_json
from fusionllm.dag.models import gpt2
from fusionllm.dht.records import DeviceInfo
from fusionllm.node.control import local_facts
from fusionllm.node.control.local_facts import FactsError, learn_local_facts, parse_facts
from tests.support.identities import cpu_device


def _costs(seq_len: int, vocab_size: int = STDLIB_VOCAB):
    with torch.device("meta"):
        model = gpt2("tiny", vocab_size=vocab_size)
    return trace(model, (torch.zeros(1, seq_len, dtype=torch.long),)).costs()


def test_costs_survive_json_exactly() -> None:
    costs = _costs(32)
    assert len(costs.nodes) > 10  # a real graph, not an empty one
    again = costs_from_json(json.loads(json.dumps(costs_to_json(costs))))
    assert again == costs
    assert again.cut_bytes() == costs.cut_bytes()


def test_a_preset_is_costed_at_the_run_vocabulary_and_cached_apart(tmp_path) -> None:
    cache = tmp_path / "device.json"
    wide = learn_local_facts("tiny", 16, device_cache=cache, measure_device=False, vocab_size=384)
    assert wide.costs == _costs(16, vocab_size=384)
    (head,) = [n for n in wide.costs.nodes if n.node_id.endswith("lm_head")]
    assert head.param_bytes == 384 * 64 * 4  # (V, C) fp32, not the bytes' 256
    narrow = learn_local_facts("tiny", 16, device_cache=cache, measure_device=False)
    assert narrow.costs == _costs(16)  # not the 384 run's cache entry
    assert (tmp_path / local_facts.costs_file_name("tiny", 16, 384)).exists()


def test_the_child_measures_and_caches_the_device(tmp_path) -> None:
    cache = tmp_path / "device.json"
    facts = learn_local_facts("tiny", 16, device_cache=cache, measure_device=True)
    assert isinstance(facts.device, DeviceInfo)
    # --device auto: the GPU where torch sees one (the child asks the same torch we do).
    assert facts.device.kind == ("cuda" if torch.cuda.is_available() else "cpu")
    assert facts.device.flops > 0
    assert cache.exists()


def test_the_child_measures_the_device_and_precision_asked_for(tmp_path) -> None:
    cache = tmp_path / "device.json"
    facts = learn_local_facts(
        "tiny", 16, device_cache=cache, measure_device=True, device="cpu", precision="bf16"
    )
    assert facts.device.kind == "cpu"
    assert ["bfloat16" in key for key in json.loads(cache.read_text())] == [True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_device_that_is_not_here_is_a_typed_error(tmp_path) -> None:
    with pytest.raises(FactsError, match="sees no CUDA device"):
        learn_local_facts(
            "tiny", 16, device_cache=tmp_path / "d.json", measure_device=True, device="cuda"
        )


def test_a_failing_child_is_a_typed_error(tmp_path) -> None:
    with pytest.raises(FactsError, match="no-such-model"):
        learn_local_facts("no-such-model", 16, device_cache=None, measure_device=False)


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ([], "not a map"),
        ({"error": "RuntimeError: boom"}, "boom"),
        ({"device": None}, "malformed"),
        ({"device": None, "costs": {"nodes": "x"}}, "malformed"),
        ({"device": {"name": "x"}, "costs": costs_to_json(_costs(8))}, "malformed"),
        ({"device": None, "costs": costs_to_json(_costs(8))}, "measured no device"),
    ],
)
def test_malformed_replies_are_refused(reply, match) -> None:
    with pytest.raises(FactsError, match=match):
        parse_facts(reply, measure_device=True)


def test_a_good_reply_parses() -> None:
    device = cpu_device()
    reply = {"device": asdict(device), "costs": costs_to_json(_costs(8))}
    facts = parse_facts(json.loads(json.dumps(reply)), measure_device=True)
    assert facts.device == device
    assert facts.costs == _costs(8)


def test_planning_imports_no_torch() -> None:
    # A fresh interpreter: the node's daemon and CLI import the planner, not torch; every
    # command builds the whole parser (gateway's limits included), and `fusionllm health`,
    # docker's HEALTHCHECK, must stay cheap.
    code = (
        "import sys\n"
        "import fusionllm.node.cli.main, fusionllm.node.swarm_node\n"
        "import fusionllm.node.control.daemon, fusionllm.dag.planner\n"
        "fusionllm.node.cli.main.build_parser().parse_args(['gateway', '--bootstrap', 'M'])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_costs_are_cached_so_a_known_device_needs_no_child(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "device.json"
    first = learn_local_facts("tiny", 24, device_cache=cache, measure_device=False)
    assert first.costs == _costs(24)  # no cache yet: the child traced what the node used to
    assert first.device is None
    costs_file = tmp_path / local_facts.costs_file_name("tiny", 24)
    assert costs_file.exists()

    def no_child(*args, **kwargs):
        raise AssertionError("the cached costs should have been used")

    monkeypatch.setattr(local_facts, "_ask_child", no_child)
    again = learn_local_facts("tiny", 24, device_cache=cache, measure_device=False)
    assert again.costs == first.costs
    with pytest.raises(AssertionError, match="cached costs"):  # other lengths are not cached
        learn_local_facts("tiny", 25, device_cache=cache, measure_device=False)


def test_a_damaged_costs_cache_is_ignored_and_rewritten(tmp_path) -> None:
    """The child (the damaged file is no cache) traces what the node used to trace."""
    cache = tmp_path / "device.json"
    costs_file = tmp_path / local_facts.costs_file_name("tiny", 20)
    costs_file.write_text('{"nodes": [{"node_id": "x"}]}')
    facts = learn_local_facts("tiny", 20, device_cache=cache, measure_device=False)
    assert facts.costs == _costs(20)
    assert facts.device is None
    assert not cache.exists()  # told not to measure: it did not
    assert costs_from_json(json.loads(costs_file.read_text())) == _costs(20)
