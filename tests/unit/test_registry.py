"""The model registry: one name space of presets, one way to build, the run spec agrees."""

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import MODELS, RunSpec
from fusionllm.dag.models import GPT2, Llama, registry


def test_run_spec_models_are_the_registry_presets() -> None:
    # common/ never imports torch, so RunSpec keeps its own list: it must be this one.
    assert tuple(MODELS) == registry.preset_names()
    assert RunSpec(model="llama-tiny").model == "llama-tiny"


@pytest.mark.parametrize(("name", "kind"), [("tiny", GPT2), ("llama-tiny", Llama)])
def test_build_preset_with_the_runs_vocabulary(name, kind) -> None:
    model = registry.build_preset(name, vocab_size=300)
    assert type(model) is kind
    assert model.config.vocab_size == 300
    x = registry.example_input(2, 8)  # (B, T)
    assert x.dtype == torch.int64
    logits = model(x)
    assert logits.shape == (2, 8, 300)
    targets = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = registry.language_model_loss(logits, targets)
    picked = logits.log_softmax(-1).gather(-1, targets[..., None])  # (B, T, 1)
    torch.testing.assert_close(loss, -picked.mean())


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'gpt5'; choose one of \['tiny'"):
        registry.build_preset("gpt5")
    with pytest.raises(ConfigError, match="no architecture is registered for int"):
        registry.build(3)
