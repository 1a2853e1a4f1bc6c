"""Llama-family decoders: names and sizes of transformers' LlamaForCausalLM, rope tables,
causality, presets and refusals. Logits against transformers are in test_pretrained.py."""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fusionllm.common.errors import ConfigError
from fusionllm.dag import trace
from fusionllm.dag.models import Llama, LlamaConfig, RopeConfig, llama
from fusionllm.dag.models.hf_config import hf_config_of
from fusionllm.dag.models.rope import inverse_frequencies


def _hf_twin(model: Llama) -> transformers.LlamaForCausalLM:
    """transformers' model for our config (via the config.json we would write), on meta."""
    config = transformers.LlamaConfig(**hf_config_of(model.config))
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(("name", "n_params"), [("llama-1b", 1_235_814_400)])
def test_llama_1b_has_llama_3_2_1b_shapes(name, n_params) -> None:
    with torch.device("meta"):
        model = llama(name)
    twin = _hf_twin(model)
    assert model.num_parameters() == n_params == twin.num_parameters()
    assert {n: p.shape for n, p in model.state_dict().items()} == {
        n: p.shape for n, p in twin.state_dict().items()
    }
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_llama_tiny_names_are_llamaforcausallm_names() -> None:
    model = llama("llama-tiny")
    assert set(model.state_dict()) == set(_hf_twin(model).state_dict())
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied preset
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA preset


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_inverse_frequencies_are_transformers(params) -> None:
    hf = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_hidden_layers=1, rope_parameters=params
    )
    kind = params["rope_type"]
    if kind == "default":
        expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf).inv_freq
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        assert scaling == 1.0
    ours = RopeConfig(
        theta=params["rope_theta"],
        kind=kind,
        **{k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")},
    )
    torch.testing.assert_close(inverse_frequencies(ours, 64), expected, atol=0, rtol=0)


def test_llama_is_causal_and_traces_on_meta() -> None:
    torch.manual_seed(0)
    model = llama("llama-tiny").eval()
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (1, 12, 256)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    with torch.device("meta"):
        big = llama("llama-1b")
    graph = trace(big, (torch.zeros(1, 2048, dtype=torch.long),))
    costs = graph.costs()
    assert sum(n.forward_flops for n in costs.nodes) > 2 * 1.2e9 * 2048  # 2 FLOPs/param/token
    assert big.model.layers[0].self_attn.rotary.inv_freq.device.type == "cpu"


def test_llama_config_refusals() -> None:
    base = {
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
    }
    assert LlamaConfig(**base).head_dim == 8
    assert LlamaConfig(**base | {"head_dim": 16}).head_dim == 16
    with pytest.raises(ConfigError, match="not a multiple of num_key_value_heads 3"):
        LlamaConfig(**base | {"num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="hidden_size 30 is not divisible"):
        LlamaConfig(**base | {"hidden_size": 30})
    with pytest.raises(ConfigError, match="head_dim must be even"):
        LlamaConfig(**base | {"head_dim": 7})
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported"):
        RopeConfig(kind="dynamic")
    with pytest.raises(ConfigError, match="low_freq_factor < high_freq_factor"):
        RopeConfig(kind="llama3", low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ConfigError, match="unknown Llama preset 'llama-70b'"):
        llama("llama-70b")
    assert llama("llama-tiny", vocab_size=300).lm_head.weight.shape == (300, 64)
    with pytest.raises(TypeError):
        LlamaConfig(1, 4, 2, 32, 48)  # keyword-only
