"""Stage workers in one process, driven by their 1F1B schedules, match the whole model.

The driver here plays the network: mailboxes keyed by (kind, stage, micro-batch), tied
gradients summed over the stages that hold them, the global norm summed over stages.
"""

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.layout import (
    PipelineLayout,
    balanced_cuts,
    crossing_values,
    cut_problem,
)
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.schedule import one_f_one_b
from fusionllm.node.pipeline.stage import StageWorker, clip_coefficient
from fusionllm.node.pipeline.train_config import TrainConfig, build_layout, build_model

ATOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def _config(**overrides) -> TrainConfig:
    base = dict(stages=2, micro_batches=3, batch_size=2, seq_len=16, steps=3, max_grad_norm=0.5)
    base.update(overrides)
    return TrainConfig(**base)


def run_in_process(config: TrainConfig, dataset: TokenDataset):
    """(per-step losses, canonical parameters) of the pipeline, every stage in this process."""
    layout = build_layout(config, build_model(config))
    workers = [
        StageWorker(layout, s, optimizer=config.optimizer, micro_batches=config.micro_batches)
        for s in range(layout.num_stages)
    ]
    stages, m = layout.num_stages, config.micro_batches
    losses = []
    for step in range(config.steps):
        mail: dict = {}
        orders = [one_f_one_b(s, stages, m) for s in range(stages)]
        cursors = [0] * stages
        step_loss = [0.0] * m
        while any(cursors[s] < len(orders[s]) for s in range(stages)):
            progressed = False
            for s, worker in enumerate(workers):
                while cursors[s] < len(orders[s]):
                    kind, mb = orders[s][cursors[s]]
                    if kind == "F":
                        if s == 0:
                            idx, _ = dataset.batch(config.batch, step, mb)
                            inputs = {"idx": idx}
                        elif ("F", s, mb) in mail:
                            inputs = layout.links[s - 1].unpack(mail.pop(("F", s, mb)))
                        else:
                            break
                        targets = (
                            dataset.batch(config.batch, step, mb)[1] if worker.is_last else None
                        )
                        out = worker.forward(step, mb, inputs, targets)
                        if worker.is_last:
                            step_loss[mb] = out
                        else:
                            mail[("F", s + 1, mb)] = layout.links[s].pack(out)
                    else:
                        if worker.is_last:
                            grads = worker.backward(step, mb)
                        elif ("B", s, mb) in mail:
                            flat = mail.pop(("B", s, mb))
                            grads = worker.backward(step, mb, layout.links[s].unpack(flat))
                        else:
                            break
                        if s > 0:
                            mail[("B", s - 1, mb)] = layout.links[s - 1].pack(grads)
                    cursors[s] += 1
                    progressed = True
            assert progressed, "the schedules deadlocked"
        assert not mail
        for name, holders in layout.tied.items():
            total = workers[holders[0]].grad(name)
            for h in holders[1:]:
                total = total + workers[h].grad(name)
            for h in holders:
                workers[h].set_grad(name, total)
        sq = sum(w.local_grad_sq_norm(layout.counted_elsewhere(w.stage)) for w in workers)
        for worker in workers:
            worker.clip_and_step(sq**0.5)
        losses.append(sum(step_loss) / m)
    params: dict[str, torch.Tensor] = {}
    for worker in workers:
        for name, value in worker.state_dict().items():
            if name in params:  # tied copies must have stayed identical
                torch.testing.assert_close(value, params[name], atol=0, rtol=0)
            params[name] = value
    return losses, params


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_in_process_matches_the_whole_model(dataset, stages) -> None:
    config = _config(stages=stages)
    reference = train_local(config, dataset=dataset)
    losses, params = run_in_process(config, dataset)
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < ATOL
    assert reference.losses[-1] < reference.losses[0]
    assert params.keys() == reference.parameters.keys()
    for name, value in reference.parameters.items():
        torch.testing.assert_close(params[name], value, atol=ATOL, rtol=0, msg=name)


def test_clipping_is_active_in_that_test(dataset) -> None:
    """With max_grad_norm 0.5 the early steps clip, so the global norm is really exercised."""
    config = _config(steps=1, max_grad_norm=0.0)
    unclipped = train_local(config, dataset=dataset)
    clipped = train_local(_config(steps=1), dataset=dataset)
    assert not all(
        torch.equal(unclipped.parameters[n], clipped.parameters[n]) for n in clipped.parameters
    )


def test_clip_coefficient() -> None:
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(2.0, 1.0) == pytest.approx(0.5)
    assert clip_coefficient(1e9, 0.0) == 1.0
    assert clip_coefficient(1e9, float("inf")) == 1.0


def test_layout_links_and_tied_parameters() -> None:
    config = _config(stages=3)
    layout = build_layout(config, build_model(config))
    assert layout.num_stages == 3
    assert layout.tied == {"transformer.wte.weight": (0, 2)}
    assert layout.counted_elsewhere(2) == frozenset({"transformer.wte.weight"})
    assert layout.counted_elsewhere(0) == frozenset()
    for link in layout.links:
        assert link.numel > 0
        flat = torch.arange(link.numel, dtype=torch.float32)
        assert torch.equal(link.pack(link.unpack(flat)), flat)


def test_bad_cuts_are_refused() -> None:
    config = _config()
    graph = build_layout(config, build_model(config)).graph
    ids = graph.node_ids
    # The position ids are int64: a cut that makes them cross is not a float link.
    cut = ids.index("transformer_wpe")
    assert "position_ids" in crossing_values(graph, cut)
    assert "int64" in cut_problem(graph, cut)
    with pytest.raises(ConfigError, match="position_ids"):
        PipelineLayout(graph, [cut])
    with pytest.raises(ConfigError, match="increasing"):
        PipelineLayout(graph, [10, 5])
    for stages in (2, 3, 4, 6):
        cuts = balanced_cuts(graph, stages)
        assert len(cuts) == stages - 1
        PipelineLayout(graph, cuts)


def test_worker_refuses_out_of_order_calls(dataset) -> None:
    config = _config()
    layout = build_layout(config, build_model(config))
    first = StageWorker(layout, 0, optimizer=config.optimizer, micro_batches=1)
    idx, _ = dataset.batch(config.batch, 0, 0)
    first.forward(0, 0, {"idx": idx})
    with pytest.raises(PipelineError, match="twice"):
        first.forward(0, 0, {"idx": idx})
    with pytest.raises(PipelineError, match="before its forward"):
        first.backward(0, 1, {})
    with pytest.raises(PipelineError, match="in flight"):
        first.clip_and_step(1.0)
    first.drop(0)
    assert first.in_flight == 0
    last = StageWorker(layout, 1, optimizer=config.optimizer, micro_batches=1)
    with pytest.raises(PipelineError, match="targets"):
        last.forward(0, 0, layout.links[0].unpack(torch.zeros(layout.links[0].numel)))


def test_link_ratios_come_from_a_plan() -> None:
    from types import SimpleNamespace

    from fusionllm.node.pipeline.train_config import ratios_from_plan

    links = [
        SimpleNamespace(src_stage=1, forward_codec="fp16", forward_ratio=1.0,
                        backward_codec="topk", backward_ratio=0.05),
        SimpleNamespace(src_stage=0, forward_codec="topk", forward_ratio=0.1,
                        backward_codec="dense", backward_ratio=1.0),
    ]  # fmt: skip
    assert ratios_from_plan(SimpleNamespace(links=links)) == ((0.1, 1.0), (1.0, 0.05))


def test_gradient_codec_is_validated_and_survives_json() -> None:
    config = _config(gradient_ratios=(0.05,), gradient_codec="ternary")
    assert TrainConfig.from_json(config.to_json()) == config
    assert _config().gradient_codec == "topk"
    with pytest.raises(ConfigError, match="gradient_codec"):
        _config(gradient_codec="sign")
