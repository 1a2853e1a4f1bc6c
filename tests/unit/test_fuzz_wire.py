"""A small, seeded run of benchmarks/fuzz.py: damaged frames, heads, records, pipe messages,
gossip, board frames and plans are accepted validly or refused with the target's typed error,
within the per-input allocation bounds; and the regressions that fuzzing found."""

import sys
from pathlib import Path

import msgpack
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import fuzz
import fuzz_targets

from fusionllm.common.errors import FrameError, peer_repr
from fusionllm.compression import pack_tensor, unpack_tensor
from fusionllm.dht.envelope import open_envelope
from fusionllm.dht.records import RecordError
from fusionllm.node.control.bandwidth import BandwidthReport

MUTATIONS = 2_000
SEED = 20261123
TARGETS = {t.name: t for t in fuzz_targets.all_targets()}
SHARES = dict(zip(TARGETS, fuzz.split(MUTATIONS, len(TARGETS)), strict=True))


def _deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_damaged_inputs_are_accepted_validly_or_refused_typed(name):
    tally = fuzz.run_target(TARGETS[name], SHARES[name], SEED)
    assert tally.untyped == 0, tally.samples
    assert tally.bad_output == 0, tally.samples
    assert tally.over_bound == 0, tally.samples
    # Both outcomes happen, or the mutator is not reaching the parser.
    assert tally.refused > tally.inputs // 4
    assert tally.accepted > 0


def test_the_harness_counts_what_it_must_refuse():
    seeds = [(b"\x01\x02", None)]
    untyped = fuzz_targets.Target(
        name="raises KeyError", seeds=seeds, decode=lambda d, _c: {}[d], allowed=(FrameError,)
    )
    assert fuzz.run_target(untyped, 20, 1).untyped == 20

    def allocate(_data, _context):
        return torch.ones(40 << 20, dtype=torch.uint8) + bytearray(9 << 20)[0]

    hungry = fuzz_targets.Target(name="allocates", seeds=seeds, decode=allocate, allowed=())
    tally = fuzz.run_target(hungry, 3, 1)
    assert tally.over_bound == 3
    assert tally.py_peak_max >= 9 << 20

    def wrong(_data, _context):
        return "out"

    def check(_out, _context):
        raise AssertionError("never right")

    bad = fuzz_targets.Target(name="bad", seeds=seeds, decode=wrong, allowed=(), check=check)
    assert fuzz.run_target(bad, 5, 1).bad_output == 5


# ----------------------------------------------------------------------------- regressions
# Found by the fuzzer: a value nested ~500 deep in an error message's {x!r} raised
# RecursionError while the typed error was being built.


def test_deeply_nested_frame_fields_are_a_frame_error():
    frame = msgpack.unpackb(pack_tensor(torch.ones(3)), raw=False)
    for field in ("v", "c", "dt", "sh"):
        damaged = dict(frame, **{field: _deep(600)})
        with pytest.raises(FrameError):
            unpack_tensor(msgpack.packb(damaged, use_bin_type=True))


def test_deeply_nested_report_version_is_a_record_error():
    wire = {"v": _deep(600), "swarm": "s", "t": 1.0, "links": []}
    with pytest.raises(RecordError, match="version"):
        BandwidthReport.from_bytes(msgpack.packb(wire, use_bin_type=True))


def test_deeply_nested_envelope_fields_are_a_record_error():
    for field in ("v", "kind"):
        envelope = {"v": 1, "kind": "node", "key": "k", "sub": "s", "exp": 1.0, "body": b"",
                    "sig": bytes(64)}  # fmt: skip
        envelope[field] = _deep(600)
        with pytest.raises(RecordError):
            open_envelope(msgpack.packb(envelope, use_bin_type=True))


def test_peer_repr_is_bounded():
    assert len(peer_repr(_deep(5000))) < 40
    assert len(peer_repr("x" * 10**6)) < 80
    assert len(peer_repr(list(range(10**5)))) < 80
    assert peer_repr("dt") == "'dt'"
