"""The model zoo: sizes and parameter names of Hugging Face GPT-2 and torchvision ResNet.

Logits against transformers' own models are in test_pretrained.py; Llama is in test_llama.py.
"""

from dataclasses import replace

import pytest
import torch
import transformers

from fusionllm.common.errors import ConfigError
from fusionllm.dag import trace
from fusionllm.dag.models import GPT2, GPT2Config, gpt2, resnet
from fusionllm.dag.models.gpt2 import Conv1D

# --- GPT-2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "n_params"),
    [
        ("small", 124_439_808),
        ("medium", 354_823_168),
        ("large", 774_030_080),
        ("xl", 1_557_611_200),
    ],
)
def test_gpt2_sizes_match_the_released_models(name: str, n_params: int) -> None:
    with torch.device("meta"):
        model = gpt2(name)
    assert model.num_parameters() == n_params
    assert model.lm_head.weight is model.transformer.wte.weight


def _hf_gpt2_names(config: GPT2Config) -> set[str]:
    """What transformers' GPT2LMHeadModel of this size holds (its mask buffers aside)."""
    hf = transformers.GPT2Config(
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
    )
    with torch.device("meta"):
        names = set(transformers.GPT2LMHeadModel(hf).state_dict())
    return {n for n in names if not n.endswith((".attn.bias", ".attn.masked_bias"))}


def test_gpt2_state_dict_names_are_gpt2lmheadmodel_names() -> None:
    model = gpt2("tiny")
    assert set(model.state_dict()) == _hf_gpt2_names(model.config)
    # A GPT2LMHeadModel state_dict (prefixed, lm_head included) loads with plain load_state_dict.
    model.load_state_dict(gpt2("tiny").state_dict(), strict=True)


def test_gpt2_untied_has_its_own_head() -> None:
    torch.manual_seed(0)
    tied = gpt2("tiny")
    torch.manual_seed(0)
    untied = GPT2(replace(tied.config, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_parameters() == tied.num_parameters() + 256 * 64
    # Untying draws the head last: every other weight is what the tied model drew.
    for name, p in tied.named_parameters():
        torch.testing.assert_close(untied.get_parameter(name), p, atol=0, rtol=0)


def test_conv1d_is_a_linear_layer_with_transposed_weight() -> None:
    layer = Conv1D(5, 3)
    x = torch.randn(2, 4, 5)
    torch.testing.assert_close(layer(x), x @ layer.weight + layer.bias)
    assert layer.weight.shape == (5, 3)


def test_gpt2_is_causal() -> None:
    model = gpt2("tiny").eval()
    idx = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (1, 10, 256)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_gpt2_overrides_and_refusals() -> None:
    model = gpt2("tiny", vocab_size=300, block_size=32, dropout=0.1)
    assert model.transformer.wte.weight.shape == (300, 64)
    assert model.transformer.wpe.weight.shape == (32, 64)
    assert (
        trace(model, torch.zeros(2, 8, dtype=torch.long)).node("transformer_drop").op == "Dropout"
    )
    with pytest.raises(ConfigError, match="unknown GPT-2 size 'huge'"):
        gpt2("huge")
    with pytest.raises(ConfigError, match="n_embd 64 is not divisible by n_head 3"):
        GPT2Config(n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ConfigError, match="dropout"):
        gpt2("tiny", dropout=1.0)
    with pytest.raises(TypeError):
        GPT2Config(2, 2, 64)  # keyword-only


# --- ResNet ---------------------------------------------------------------------------------


def _torchvision_keys(blocks: tuple[int, ...], *, bottleneck: bool) -> set[str]:
    def bn(prefix: str) -> list[str]:
        parts = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
        return [f"{prefix}.{part}" for part in parts]

    keys = ["conv1.weight", *bn("bn1"), "fc.weight", "fc.bias"]
    for layer, count in enumerate(blocks, start=1):
        for j in range(count):
            p = f"layer{layer}.{j}."
            for c in range(1, 4 if bottleneck else 3):
                keys += [f"{p}conv{c}.weight", *bn(f"{p}bn{c}")]
            if j == 0 and (layer > 1 or bottleneck):
                keys += [f"{p}downsample.0.weight", *bn(f"{p}downsample.1")]
    return set(keys)


@pytest.mark.parametrize(
    ("depth", "blocks", "bottleneck", "n_params"),
    [
        (18, (2, 2, 2, 2), False, 11_689_512),
        (34, (3, 4, 6, 3), False, 21_797_672),
        (50, (3, 4, 6, 3), True, 25_557_032),
        (101, (3, 4, 23, 3), True, 44_549_160),
        (152, (3, 8, 36, 3), True, 60_192_808),
    ],
)
def test_resnet_matches_torchvision(depth, blocks, bottleneck, n_params) -> None:
    with torch.device("meta"):
        model = resnet(depth)
    assert set(model.state_dict()) == _torchvision_keys(blocks, bottleneck=bottleneck)
    assert sum(p.numel() for p in model.parameters()) == n_params
    if bottleneck:
        # v1.5: the stride sits on the 3x3 convolution.
        assert model.layer2[0].conv1.stride == (1, 1)
        assert model.layer2[0].conv2.stride == (2, 2)
        assert model.layer1[0].downsample[0].weight.shape == (256, 64, 1, 1)
        assert model.fc.weight.shape == (1000, 2048)


def test_resnet_forward_and_refusals() -> None:
    model = resnet(18, num_classes=10).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match=r"depth must be one of .* got 20"):
        resnet(20)
    with pytest.raises(ConfigError, match="num_classes"):
        resnet(18, num_classes=0)
