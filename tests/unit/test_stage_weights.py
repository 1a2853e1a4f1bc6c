"""A stage built alone (model on meta, only its parameters made real) holds exactly what the
same stage cut from the whole model holds, for presets and folders, and nothing of the others."""

import pytest
import torch

from fusionllm.common.run_spec import FOLDER
from fusionllm.dag.models import save_pretrained
from fusionllm.dag.models.hf_errors import TensorShapeError, TensorValueError
from fusionllm.dag.models.hf_tensors import write_tensors
from fusionllm.dag.models.materialise import SeededInit, materialise, parameter_seed
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.stage import OptimizerConfig, StageWorker
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_layout,
    build_model,
    model_config,
    weight_source,
)

PRESETS = ("tiny", "llama-tiny")


class _Recording:
    """A weight source that remembers which names it was asked for."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.asked: list[str] = []

    def tensors(self, shapes):
        self.asked.extend(shapes)
        return self.inner.tensors(shapes)


def _config(preset: str, folder=None, stages: int = 3) -> TrainConfig:
    if folder is None:
        return TrainConfig(model=preset, stages=stages, seq_len=16, batch_size=2, seed=7)
    return TrainConfig(model=FOLDER, model_dir=str(folder), stages=stages, seq_len=16, seed=7)


@pytest.fixture(scope="module", params=PRESETS)
def folder(request, tmp_path_factory):
    """A Hugging Face folder holding a preset's seeded weights (seed 3: not the runs' seed)."""
    path = tmp_path_factory.mktemp(request.param)
    save_pretrained(build_model(TrainConfig(model=request.param, seed=3)), path)
    return path


def _worker(layout, stage: int, config: TrainConfig, weights=None) -> StageWorker:
    return StageWorker(layout, stage, optimizer=OptimizerConfig(), micro_batches=1, weights=weights)


def _assert_stage_alone_equals_stage_cut(config: TrainConfig) -> None:
    whole = build_layout(config, build_model(config))
    alone = build_layout(config, build_model(config, meta=True))
    assert all(p.is_meta for p in alone.graph.graph_module.parameters())
    total = sum(p.numel() for p in build_model(config, meta=True).parameters())
    for stage in range(config.stages):
        recording = _Recording(weight_source(config))
        cut = _worker(whole, stage, config).module
        built = _worker(alone, stage, config, recording).module
        expected = dict(cut.named_parameters(remove_duplicate=False))
        got = dict(built.named_parameters(remove_duplicate=False))
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            assert got[name].shape == value.shape, name
            assert torch.equal(got[name], value), name
        # It asked for its own parameters only, each once, and holds nothing else.
        assert sorted(recording.asked) == sorted(set(alone.stage_parameter_names(stage).values()))
        held = sum(p.numel() for p in built.parameters())
        assert held == sum(p.numel() for p in cut.parameters()) < total
        assert not any(p.is_meta for p in built.parameters())


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_stage_built_alone_equals_the_stage_cut_from_the_whole_model(preset) -> None:
    _assert_stage_alone_equals_stage_cut(_config(preset))


def test_a_folder_stage_built_alone_equals_the_stage_cut_from_the_whole_model(folder) -> None:
    _assert_stage_alone_equals_stage_cut(_config("", folder))


def test_the_whole_model_from_a_folder_holds_the_folders_values(folder) -> None:
    from fusionllm.dag.models import from_pretrained

    ours = build_model(_config("", folder)).state_dict()
    theirs = from_pretrained(folder).state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_a_tied_embedding_is_one_tensor_in_one_stage_and_equal_copies_across_stages() -> None:
    one = _config("tiny", stages=1)
    module = _worker(build_layout(one, build_model(one, meta=True)), 0, one, weight_source(one))
    head, embedding = module.module.lm_head.weight, module.module.transformer.wte.weight
    assert head is embedding
    two = _config("tiny", stages=2)
    layout = build_layout(two, build_model(two, meta=True))
    assert layout.tied == {"transformer.wte.weight": (0, 1)}
    first = _worker(layout, 0, two, weight_source(two)).module.transformer.wte.weight
    last = _worker(layout, 1, two, weight_source(two)).module.lm_head.weight
    assert first is not last
    assert torch.equal(first, last)
    assert torch.equal(first, embedding)


def test_a_parameters_values_depend_on_the_seed_and_its_name_only() -> None:
    config = model_config(_config("tiny"))
    alone = SeededInit(config, 7).tensors({"transformer.h.1.attn.c_attn.weight": (64, 192)})
    with_others = SeededInit(config, 7).tensors(
        {"transformer.wte.weight": (256, 64), "transformer.h.1.attn.c_attn.weight": (64, 192)}
    )
    name = "transformer.h.1.attn.c_attn.weight"
    assert torch.equal(alone[name], with_others[name])
    other_seed = SeededInit(config, 8).tensor(name, (64, 192))
    assert not torch.equal(alone[name], other_seed)
    assert parameter_seed(7, name) != parameter_seed(7, "transformer.h.0.attn.c_attn.weight")


@pytest.mark.parametrize("preset", PRESETS)
def test_the_seeded_init_follows_the_architectures_rules(preset) -> None:
    model = build_model(_config(preset))
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "norm" in name or ".ln_" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = 0.02 / (2 * layers) ** 0.5 if name.endswith("c_proj.weight") else 0.02
            assert float(p.detach().std()) == pytest.approx(std, rel=0.1), name
            assert abs(float(p.detach().mean())) < std / 5, name


def test_a_meta_stage_without_weights_is_refused() -> None:
    config = _config("tiny")
    layout = build_layout(config, build_model(config, meta=True))
    with pytest.raises(PipelineError, match="meta device and no weights"):
        _worker(layout, 1, config)


def test_a_stage_reads_no_other_stages_values_but_checks_every_header(tmp_path) -> None:
    config = _config("tiny", tmp_path, stages=2)
    state = build_model(TrainConfig(model="tiny", seed=3)).state_dict()
    save_pretrained(build_model(TrainConfig(model="tiny", seed=3)), tmp_path)
    layout = build_layout(config, build_model(config, meta=True))
    late = "transformer.h.1.mlp.c_fc.weight"
    assert late in layout.stage_parameter_names(1).values()
    assert late not in layout.stage_parameter_names(0).values()
    tensors = {n: t.clone() for n, t in state.items() if n != "lm_head.weight"}
    tensors[late][0, 0] = float("nan")
    write_tensors(tmp_path, tensors)
    _worker(layout, 0, config, weight_source(config))  # its own values are all finite
    with pytest.raises(TensorValueError, match="NaN"):
        _worker(layout, 1, config, weight_source(config))
    tensors[late] = torch.zeros(3, 3)  # a header that does not match: refused by every stage
    write_tensors(tmp_path, tensors)
    with pytest.raises(TensorShapeError, match="c_fc"):
        _worker(layout, 0, config, weight_source(config))


def test_materialise_keeps_real_parameters_and_fills_meta_ones() -> None:
    config = model_config(_config("tiny"))
    model = build_model(_config("tiny"), meta=True)
    real = torch.nn.Parameter(torch.full((64,), 5.0))
    model.transformer.ln_f.weight = real
    made = materialise(model, SeededInit(config, 7))
    assert "transformer.ln_f.weight" not in made
    assert model.transformer.ln_f.weight is real
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("preset", PRESETS)
def test_a_stage_resumed_from_state_never_reads_its_weights(preset) -> None:
    """Deferred (a session's worker), the stage stays on meta until its start is known; when
    a checkpoint's state is imported into every parameter, the weight source is never asked
    (no init pass, no folder read) and the imported state is exactly what the stage holds."""
    config = _config(preset)
    layout = build_layout(config, build_model(config, meta=True))
    source = _Recording(weight_source(config))
    worker = StageWorker(
        layout, 1, optimizer=OptimizerConfig(), micro_batches=1, weights=source, deferred=True
    )
    assert worker.parameters
    assert all(p.is_meta for p in worker.parameters.values())
    donor = _worker(layout, 1, config, weight_source(config))
    with torch.no_grad():
        for p in donor.parameters.values():
            p.add_(1.0)  # not the init's values: a trained checkpoint's
    worker.make_real(initialise=False)
    for name in donor.parameters:
        worker.import_state(name, donor.export_state(name))
    assert source.asked == []
    assert not any(p.is_meta for p in worker.parameters.values())
    for name, p in donor.parameters.items():
        assert torch.equal(worker.parameters[name].detach(), p.detach()), name
    assert isinstance(worker.optimizer, torch.optim.AdamW)
    assert set(worker.optimizer.param_groups[0]["params"]) == set(worker.parameters.values())


def test_a_deferred_stage_starting_at_the_seed_step_is_initialised_as_usual() -> None:
    config = _config("tiny")
    layout = build_layout(config, build_model(config, meta=True))
    source = _Recording(weight_source(config))
    worker = StageWorker(
        layout, 0, optimizer=OptimizerConfig(), micro_batches=1, weights=source, deferred=True
    )
    worker.make_real()
    eager = _worker(layout, 0, config, weight_source(config))
    assert sorted(source.asked) == sorted(eager.parameters)
    for name, p in eager.parameters.items():
        assert torch.equal(worker.parameters[name].detach(), p.detach()), name
