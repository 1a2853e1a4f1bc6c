"""The real ``PipelineRunner``s, one thread per stage replica, over the in-memory transport.

Equivalence: a pipeline run (1F1B, data-parallel replicas, tied GPT-2 embeddings, the global
norm and clipping, AdamW) equals ``train_local`` on the whole model to 1e-5, as the
multi-process tests assert over py-libp2p. Failures: what the surviving runners do when a peer
dies, stalls, is lost, lies in its summary or is a stranger -- each within a short timeout.
"""

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
import torch

from fusionllm.compression import pack_tensor, unpack_tensor
from fusionllm.node.errors import PipelineError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.expectations import TAG_SUMMARY, TAG_TIED, Expectations
from fusionllm.node.pipeline.layout import WIRE_DTYPE
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.train_config import TrainConfig
from tests.support.memory_transport import FrameMatch
from tests.support.pipeline_threads import ThreadSwarm, peer_id_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-5
FAIL_TIMEOUT_S = 1.0  # the runners' frame timeout in the failure tests
# A survivor notices within its frame timeout; this much more is allowed for a busy host.
SLACK_S = 2.0


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def _config(**overrides) -> TrainConfig:
    base = dict(micro_batches=4, batch_size=2, seq_len=16, steps=3, max_grad_norm=0.5)
    base.update(overrides)
    return TrainConfig(**base)


def _run(config: TrainConfig, dataset: TokenDataset, **swarm_args) -> ThreadSwarm:
    return ThreadSwarm.trained(config, dataset, **swarm_args)


# ----- the same run as one process -----------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "replicas"),
    [(2, None), (3, (1, 2, 1)), (4, None)],
    ids=["2-stages", "3-stages-replicas-1-2-1", "4-stages"],
)
def test_runners_match_one_process(dataset, stages, replicas) -> None:
    config = _config(stages=stages, replicas=replicas)
    reference = train_local(config, dataset=dataset)
    assert reference.losses[-1] < reference.losses[0]
    swarm = _run(config, dataset)
    assert swarm.errors() == {}
    # GPT-2 ties wte and lm_head: the first and last stage each hold a copy, kept identical
    # (swarm.parameters() asserts every copy, tied and replicated, bit-identical).
    assert swarm.layout.tied == {"transformer.wte.weight": (0, stages - 1)}
    losses = swarm.losses()
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < ATOL
    for role, run in swarm.results.items():  # every process saw the same global losses
        assert [r.loss for r in run.reports] == losses, role
        assert run.reports[0].grad_norm > config.max_grad_norm, "clipping is not exercised"
        for report in run.reports:  # a thread's CPU time never exceeds its wall time
            assert 0 < report.busy_cpu_s <= report.busy_s + 1e-4, (role, report)
            # the step's CPU holds its compute's, and fits in the step
            assert report.busy_cpu_s <= report.step_cpu_s <= report.seconds + 1e-4, (role, report)
    params = swarm.parameters()
    assert params.keys() == reference.parameters.keys()
    for name, value in reference.parameters.items():
        torch.testing.assert_close(params[name], value, atol=ATOL, rtol=0, msg=name)
    assert all(runner.mailbox.refused == 0 for runner in swarm.runners.values())
    assert all(runner.mailbox.pending() == [] for runner in swarm.runners.values())


def test_a_llama_pipeline_matches_one_process(dataset) -> None:
    """An untied head (nothing to keep equal across stages), GQA and rotary in the stages."""
    config = _config(model="llama-tiny", stages=3, replicas=(1, 2, 1))
    reference = train_local(config, dataset=dataset)
    assert reference.losses[-1] < reference.losses[0]
    swarm = _run(config, dataset)
    assert swarm.errors() == {}
    assert swarm.layout.tied == {}
    losses = swarm.losses()
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < ATOL
    params = swarm.parameters()
    assert params.keys() == reference.parameters.keys()
    for name, value in reference.parameters.items():
        torch.testing.assert_close(params[name], value, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("gradient_codec", ["topk", "ternary"])
def test_a_compressed_link_still_converges(dataset, gradient_codec) -> None:
    """Both directions of the one link at ratio 0.1: it learns about as fast as the dense run
    (measured here: last-3 mean +0.6% top-k, +0.2% ternary), and it is not the dense run."""
    config = _config(
        stages=2,
        steps=8,
        lr=3e-3,
        activation_ratios=(0.1,),
        gradient_ratios=(0.1,),
        gradient_codec=gradient_codec,
    )
    dense = train_local(_config(stages=2, steps=8, lr=3e-3), dataset=dataset)
    swarm = ThreadSwarm(config, dataset)
    link_frames = swarm.network.tap(FrameMatch(kind=FrameKind.ACTIVATION))
    gradient_frames = swarm.network.tap(FrameMatch(kind=FrameKind.GRADIENT))
    try:
        swarm.run()
    finally:
        swarm.close()
    assert swarm.errors() == {}
    losses = swarm.losses()
    assert sum(losses[-3:]) / 3 < losses[0] * 0.9, losses
    assert sum(losses[-3:]) < sum(dense.losses[-3:]) * 1.05, (losses, dense.losses)
    assert max(abs(a - b) for a, b in zip(losses, dense.losses, strict=True)) > 1e-3
    # Both directions really were compressed: every link frame well under the dense bytes.
    dense_bytes = len(pack_tensor(torch.zeros(swarm.layout.links[0].numel)))
    for tap in (link_frames, gradient_frames):
        assert tap.hits == config.steps * config.micro_batches
        assert max(len(frame.body) for frame in tap.frames) < 0.2 * dense_bytes
    # The step reports tally the same bytes (what --metrics shows per link), dense and sent.
    numel = swarm.layout.links[0].numel
    codecs = {"activation": {"tern", "topk"}, "gradient": {"topk"} if gradient_codec == "topk"
              else {"tern", "topk"}}  # fmt: skip
    for tap, kind in ((link_frames, "activation"), (gradient_frames, "gradient")):
        tallies = [t for run in swarm.results.values() for r in run.reports for t in r.links
                   if t.kind == kind]  # fmt: skip
        assert len(tallies) == config.steps
        assert {t.link for t in tallies} == {0}
        assert sum(t.wire_bytes for t in tallies) == sum(len(f.body) for f in tap.frames)
        assert sum(t.frames for t in tallies) == tap.hits
        assert all(t.dense_bytes == config.micro_batches * numel * 4 for t in tallies)
        assert {t.codec for t in tallies} <= codecs[kind], tallies


def test_half_links_halve_the_bytes_on_the_wire(dataset) -> None:
    """A link the plan counts at 2 bytes an element (its "fp16" codec) sends 2-byte floats:
    each frame about half the dense one, and the run still follows the reference closely."""
    config = _config(stages=2, steps=4, activation_halves=(True,), gradient_halves=(True,))
    reference = train_local(config, dataset=dataset)
    swarm = ThreadSwarm(config, dataset)
    taps = [swarm.network.tap(FrameMatch(kind=kind)) for kind in (FrameKind.ACTIVATION,
                                                                  FrameKind.GRADIENT)]  # fmt: skip
    try:
        swarm.run()
    finally:
        swarm.close()
    assert swarm.errors() == {}
    dense_bytes = len(pack_tensor(torch.zeros(swarm.layout.links[0].numel)))
    for tap in taps:
        assert tap.hits == config.steps * config.micro_batches
        for frame in tap.frames:
            assert 0.5 * dense_bytes <= len(frame.body) <= 0.52 * dense_bytes, len(frame.body)
    gap = max(abs(a - b) for a, b in zip(swarm.losses(), reference.losses, strict=True))
    assert 0 < gap < 1e-2, (swarm.losses(), reference.losses)


def test_half_links_carry_gradients_far_beyond_float16s_range(dataset) -> None:
    """fp16's loss scale (2**16 and growing) puts link gradients past float16's ±65504: a half
    link scales each frame by a power of two, so they still travel as float16 (11 bits, not
    bfloat16's 8) and arrive as sent to float16's rounding."""
    config = _config(stages=2, steps=1, activation_halves=(True,), gradient_halves=(True,))
    swarm = ThreadSwarm(config, dataset)
    try:
        runner = swarm.runners[Role(1, 0)]
        numel = swarm.layout.links[0].numel
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 1e9  # (N,)
        for body in (runner._pack_gradient(0, Role(0, 0), gradient),
                     runner.activation_body(0, gradient)):  # fmt: skip
            fields = msgpack.unpackb(body, raw=False)
            assert fields["wd"] == "float16"
            assert len(body) <= 0.52 * len(pack_tensor(gradient))
            decoded = unpack_tensor(body)
            relative = (decoded - gradient).abs() / gradient.abs()
            assert float(relative.max()) <= 2.0**-11
    finally:
        swarm.close()


# ----- failures ----------------------------------------------------------------------------


def _survivors(swarm: ThreadSwarm, *dead: Role) -> dict[Role, BaseException]:
    errors = swarm.errors()
    return {role: errors.get(role) for role in swarm.roles if role not in dead}


def test_a_peer_that_dies_mid_step_fails_every_survivor_within_the_timeout(dataset) -> None:
    config = _config(stages=3, steps=4)
    middle = Role(1, 0)
    swarm = ThreadSwarm(config, dataset, timeout_s=FAIL_TIMEOUT_S)
    # Stage 1 dies as it sends the first gradient of step 1: its peers hold half-done steps.
    death = swarm.network.kill_on(
        FrameMatch(src=peer_id_of(middle), kind=FrameKind.GRADIENT, step=1), peer_id_of(middle)
    )
    try:
        swarm.run(join_timeout_s=30)
    finally:
        swarm.close()
    assert death.fired_at is not None
    for role, error in _survivors(swarm, middle).items():
        assert isinstance(error, PipelineError), (role, error)
        # It names the dead peer: a send to it failed, or a frame from it never came.
        assert peer_id_of(middle) in str(error) or str(middle) in str(error), error
        run = swarm.results[role]
        assert [r.step for r in run.reports] == [0], role
        assert run.failed_at is not None
        assert run.failed_at - death.fired_at < FAIL_TIMEOUT_S + SLACK_S, role


@pytest.mark.parametrize("fault", ["stall", "drop", "garble"])
def test_a_missing_frame_is_named_by_the_runner_that_waits_for_it(dataset, fault) -> None:
    """The activation of micro-batch 2, step 1, never reaches stage 1, for three reasons."""
    config = _config(stages=2, steps=3)
    first, last = Role(0, 0), Role(1, 0)
    swarm = ThreadSwarm(config, dataset, timeout_s=FAIL_TIMEOUT_S)
    match = FrameMatch(src=peer_id_of(first), kind=FrameKind.ACTIVATION, step=1, tag=2)
    if fault == "stall":  # stage 0 hangs from that frame on: it sends nothing more
        swarm.network.stall_on(match, peer_id_of(first))
    elif fault == "drop":  # lost on the way
        swarm.network.drop(match)
    else:  # refused by stage 1's transport
        swarm.network.corrupt(match, lambda body: body[: len(body) // 2])
    try:
        swarm.run(join_timeout_s=30)
    finally:
        swarm.close()
    error = swarm.errors()[last]
    assert isinstance(error, PipelineError)
    assert re.search(
        rf"activation frame \(step 1, tag 2\) from {re.escape(str(first))}", str(error)
    )
    assert [r.step for r in swarm.results[last].reports] == [0]
    refusals = swarm.transports[last].stats()[peer_id_of(first)].errors
    assert refusals == ({"FrameError": 1} if fault == "garble" else {})
    assert isinstance(swarm.errors().get(first), PipelineError)  # and stage 0 gives up too


@pytest.mark.parametrize("stages", [2, 3])
def test_the_last_stage_sends_its_summary_before_it_waits_for_the_tied_sum(dataset, stages):
    """Its share of the norm leaves the tied embedding to stage 0, so stage 0 can end step 0
    with the tied gradient it sent never arriving: the summary did not wait for it (the step
    then ends one link latency after stage 0's last backward, not two)."""
    config = _config(stages=stages, steps=2)
    first, last = Role(0, 0), Role(stages - 1, 0)
    swarm = ThreadSwarm(config, dataset, timeout_s=FAIL_TIMEOUT_S)
    tied = FrameMatch(
        src=peer_id_of(first), dst=peer_id_of(last), kind=FrameKind.CONTROL, step=0, tag=TAG_TIED
    )
    lost = swarm.network.drop(tied)
    try:
        swarm.run(join_timeout_s=30)
    finally:
        swarm.close()
    assert lost.hits == 1
    assert swarm.results[first].reports[0].step == 0  # the whole step, optimizer included
    error = swarm.errors()[last]
    assert isinstance(error, PipelineError)
    assert re.search(
        rf"control frame \(step 0, tag {TAG_TIED}\) from {re.escape(str(first))}", str(error)
    )


def _with_first_value(value: float):
    def rewrite(body: bytes) -> bytes:
        summary = unpack_tensor(body).clone()  # float64 [squared norm, loss sum, ...]
        summary[0] = value
        return pack_tensor(summary)

    return rewrite


def test_a_negative_summary_fails_the_step_of_whoever_receives_it(dataset) -> None:
    config = _config(stages=2, steps=2)
    first, last = Role(0, 0), Role(1, 0)
    swarm = ThreadSwarm(config, dataset, timeout_s=FAIL_TIMEOUT_S)
    match = FrameMatch(
        src=peer_id_of(first), dst=peer_id_of(last), kind=FrameKind.CONTROL, step=1, tag=TAG_SUMMARY
    )
    swarm.network.corrupt(match, _with_first_value(-1.0))
    try:
        swarm.run(join_timeout_s=30)
    finally:
        swarm.close()
    error = swarm.errors()[last]
    assert isinstance(error, PipelineError)
    assert str(error).startswith("step 1: bad summary [-1.0, "), error
    assert str(error).endswith(f" from {first}"), error
    assert [r.step for r in swarm.results[last].reports] == [0]
    assert [r.step for r in swarm.results[first].reports] == [0, 1]  # its summaries were fine


def test_a_non_finite_summary_is_refused_by_the_transport(dataset) -> None:
    """NaN never reaches the runner's own check: FrameLimits refuse non-finite tensors, so the
    receiver sees a summary that never came (after its timeout), not a bad one."""
    config = _config(stages=2, steps=2)
    first, last = Role(0, 0), Role(1, 0)
    swarm = ThreadSwarm(config, dataset, timeout_s=FAIL_TIMEOUT_S)
    match = FrameMatch(src=peer_id_of(first), kind=FrameKind.CONTROL, step=1, tag=TAG_SUMMARY)
    swarm.network.corrupt(match, _with_first_value(float("nan")))
    try:
        swarm.run(join_timeout_s=30)
    finally:
        swarm.close()
    error = swarm.errors()[last]
    assert isinstance(error, PipelineError)
    assert f"control frame (step 1, tag {TAG_SUMMARY}) from {first} did not arrive" in str(error)
    assert swarm.transports[last].stats()[peer_id_of(first)].errors == {"FrameError": 1}


@contextmanager
def _mailbox_refusals() -> Iterator[list[str]]:
    """Why the mailboxes refused frames: the errors they log at debug level."""
    reasons: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info is not None:
                reasons.append(str(record.exc_info[1]))

    log = logging.getLogger("fusionllm.node.pipeline.mailbox")
    handler, level = Collect(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield reasons
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_frames_from_strangers_and_impostors_are_refused_and_counted(dataset) -> None:
    """Refused, counted, and the run goes on to the single-process result."""
    config = _config(stages=3, steps=2)
    reference = train_local(config, dataset=dataset)
    swarm = ThreadSwarm(config, dataset, timeout_s=10)
    middle, last = Role(1, 0), Role(2, 0)
    target = peer_id_of(middle)
    numel = swarm.layout.links[0].numel
    activation = FrameHeader(step=0, micro_batch=1, kind=FrameKind.ACTIVATION, stage=0)
    expect = Expectations(config, swarm.layout, Role(0, 0)).expect
    stranger = swarm.network.transport("stranger", expect=expect)
    body = pack_tensor(torch.zeros(numel, dtype=WIRE_DTYPE))
    stranger.send_async(target, activation, body).result(0)
    # Stage 2 claims to be stage 0 (the frame itself is well formed for that claim).
    swarm.transports[last].send_async(target, activation, body).result(0)
    # Stage 2 sends a gradient of the wrong size: stage 1's transport refuses it.
    gradient = FrameHeader(step=0, micro_batch=1, kind=FrameKind.GRADIENT, stage=2)
    too_long = pack_tensor(torch.zeros(swarm.layout.links[1].numel + 1, dtype=WIRE_DTYPE))
    swarm.transports[last].send_async(target, gradient, too_long).result(0)
    with _mailbox_refusals() as reasons:
        try:
            swarm.run(join_timeout_s=30)
        finally:
            swarm.close()
    assert swarm.errors() == {}
    assert sorted(reasons) == [
        "frame from unknown peer stranger",
        "rank 2: header says stage 0, the sender is stage 2",
    ]
    assert {role: r.mailbox.refused for role, r in swarm.runners.items()} == {
        Role(0, 0): 0,
        middle: 2,
        last: 0,
    }
    assert swarm.transports[middle].stats()[peer_id_of(last)].errors == {"FrameError": 1}
    losses = swarm.losses()
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < ATOL


@pytest.mark.parametrize(("stages", "replicas"), [(3, (1, 2, 1)), (1, (2,))])
def test_validation_loss_matches_one_process_and_every_process_learns_it(
    dataset, stages, replicas
) -> None:
    """--eval-every: at the start of every 2nd step the held-out micro-batches run forward
    through the stages (replicas splitting them, as in training); every process ends the step
    with the loss a single process computes on the same parameters, and training itself is
    unchanged."""
    config = _config(stages=stages, replicas=replicas, steps=5, eval_every=2)
    reference = train_local(config, dataset=dataset)
    assert sorted(reference.eval_losses) == [0, 2, 4]
    assert reference.eval_losses[4] < reference.eval_losses[0]
    plain = train_local(_config(stages=stages, replicas=replicas, steps=5), dataset=dataset)
    assert plain.losses == reference.losses  # evaluating changes no parameter
    swarm = _run(config, dataset)
    assert swarm.errors() == {}
    assert max(abs(a - b) for a, b in zip(swarm.losses(), reference.losses, strict=True)) < ATOL
    for role, run in swarm.results.items():
        evals = {r.step: r.eval_loss for r in run.reports if r.eval_loss is not None}
        assert evals.keys() == reference.eval_losses.keys(), role
        for step, loss in evals.items():
            assert abs(loss - reference.eval_losses[step]) < ATOL, (role, step)
    assert all(runner.mailbox.refused == 0 for runner in swarm.runners.values())


def test_a_validation_frame_off_an_evaluation_step_is_refused(dataset) -> None:
    from fusionllm.node.pipeline.expectations import EVAL_TAG

    config = _config(stages=2, eval_every=3)
    swarm = ThreadSwarm(config, dataset)
    try:
        expectations = Expectations(config, swarm.layout, Role(1, 0))
        header = FrameHeader(step=4, micro_batch=EVAL_TAG + 1, kind=FrameKind.ACTIVATION, stage=0)
        assert expectations.admit(0, header) == "no evaluation at step 4"
        on_step = FrameHeader(step=6, micro_batch=EVAL_TAG + 1, kind=FrameKind.ACTIVATION, stage=0)
        assert expectations.admit(0, on_step) is None
        beyond = FrameHeader(step=6, micro_batch=EVAL_TAG + 4, kind=FrameKind.ACTIVATION, stage=0)
        assert expectations.admit(0, beyond) == "micro-batch 4 is not ours"
    finally:
        swarm.close()
