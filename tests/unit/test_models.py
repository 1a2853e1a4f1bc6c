"""The model zoo: sizes, checkpoint names/layouts of Hugging Face GPT-2 and torchvision ResNet."""

import math

import pytest
import torch
from torch.nn import functional

from fusionllm.common.errors import ConfigError
from fusionllm.dag import trace
from fusionllm.dag.models import GPT2Config, gpt2, load_hf_state_dict, resnet
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


def _hf_checkpoint(config: GPT2Config, *, seed: int) -> dict[str, torch.Tensor]:
    """A GPT2Model state_dict as HF saves it: no prefix, Conv1D (in, out) weights, mask buffers."""
    g = torch.Generator().manual_seed(seed)
    c, t = config.n_embd, config.block_size

    def rnd(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    state = {"wte.weight": rnd(config.vocab_size, c), "wpe.weight": rnd(t, c)}
    for i in range(config.n_layer):
        p = f"h.{i}."
        state |= {
            p + "ln_1.weight": 1 + rnd(c),
            p + "ln_1.bias": rnd(c),
            p + "attn.bias": torch.tril(torch.ones(t, t, dtype=torch.bool)).view(1, 1, t, t),
            p + "attn.masked_bias": torch.tensor(-1e4),
            p + "attn.c_attn.weight": rnd(c, 3 * c),
            p + "attn.c_attn.bias": rnd(3 * c),
            p + "attn.c_proj.weight": rnd(c, c),
            p + "attn.c_proj.bias": rnd(c),
            p + "ln_2.weight": 1 + rnd(c),
            p + "ln_2.bias": rnd(c),
            p + "mlp.c_fc.weight": rnd(c, 4 * c),
            p + "mlp.c_fc.bias": rnd(4 * c),
            p + "mlp.c_proj.weight": rnd(4 * c, c),
            p + "mlp.c_proj.bias": rnd(c),
        }
    state |= {"ln_f.weight": 1 + rnd(c), "ln_f.bias": rnd(c)}
    return state


def _hf_reference_logits(state, idx, config: GPT2Config) -> torch.Tensor:
    """HF's GPT-2 forward written out: explicit masked softmax attention, gelu_new."""
    c, nh = config.n_embd, config.n_head
    hs = c // nh
    t = idx.shape[1]

    def ln(x, p):
        return functional.layer_norm(x, (c,), state[p + ".weight"], state[p + ".bias"], 1e-5)

    def gelu_new(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = state["wte.weight"][idx] + state["wpe.weight"][:t]  # (B, T, C)
    for i in range(config.n_layer):
        p = f"h.{i}."
        qkv = ln(x, p + "ln_1") @ state[p + "attn.c_attn.weight"] + state[p + "attn.c_attn.bias"]
        q, k, v = (z.view(*z.shape[:2], nh, hs).transpose(1, 2) for z in qkv.split(c, dim=2))
        w = q @ k.transpose(-1, -2) / math.sqrt(hs)  # (B, nh, T, T)
        w = torch.where(state[p + "attn.bias"][:, :, :t, :t], w, torch.finfo(w.dtype).min)
        a = (w.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape)
        x = x + a @ state[p + "attn.c_proj.weight"] + state[p + "attn.c_proj.bias"]
        h = gelu_new(ln(x, p + "ln_2") @ state[p + "mlp.c_fc.weight"] + state[p + "mlp.c_fc.bias"])
        x = x + h @ state[p + "mlp.c_proj.weight"] + state[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ state["wte.weight"].T  # (B, T, vocab)


def test_gpt2_loads_a_hugging_face_checkpoint_and_computes_what_hf_computes() -> None:
    model = gpt2("tiny")
    config = model.config
    state = _hf_checkpoint(config, seed=0)
    load_hf_state_dict(model, state)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            model(idx), _hf_reference_logits(state, idx, config), atol=1e-5, rtol=1e-5
        )


def test_gpt2_state_dict_names_are_gpt2lmheadmodel_names() -> None:
    model = gpt2("tiny")
    hf_keys = {
        f"transformer.{k}"
        for k in _hf_checkpoint(model.config, seed=0)
        if not k.endswith((".attn.bias", ".attn.masked_bias"))
    } | {"lm_head.weight"}
    assert set(model.state_dict()) == hf_keys
    # A GPT2LMHeadModel checkpoint (prefixed, lm_head included) loads with plain load_state_dict.
    model.load_state_dict(gpt2("tiny").state_dict(), strict=True)


def test_load_hf_state_dict_refuses_wrong_shapes() -> None:
    model = gpt2("tiny")
    state = _hf_checkpoint(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=256), seed=0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_hf_state_dict(model, state)


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
