"""LoRA and LoRA-FA adapters: LoRA-FA's hand-written backward against autograd (fp64 gradcheck),
what each keeps for backward (saved-tensor hooks), wrapping, freezing, seeding, tracing, merging."""

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.dag import trace
from fusionllm.dag.models import gpt2, llama
from fusionllm.dag.models.gpt2 import Conv1D
from fusionllm.dag.models.lora import (
    AdapterError,
    AdapterInit,
    LoraConfig,
    LoraFADelta,
    LoraLinear,
    add_adapters,
    init_a,
    merge_adapters,
)
from fusionllm.dag.models.materialise import SeededInit, materialise
from fusionllm.dag.models.registry import example_input


def _randomised(layer: LoraLinear, seed: int = 0) -> LoraLinear:
    """Non-zero A and B, so the adapter's path shows in outputs and gradients."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (layer.weight, layer.lora_A, layer.lora_B):
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return layer


def test_lora_fa_backward_passes_gradcheck_in_fp64() -> None:
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)  # (N, in)
    a = torch.randn(3, 5, dtype=torch.float64)  # (r, in), frozen
    b = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)  # (out, r)
    assert torch.autograd.gradcheck(lambda x, b: LoraFADelta.apply(x, a, b, 0.7), (x, b))


@pytest.mark.parametrize("conv1d", [True, False], ids=["conv1d", "linear"])
def test_lora_fa_gradients_equal_autograds_with_a_frozen(conv1d) -> None:
    base = Conv1D(5, 4) if conv1d else torch.nn.Linear(5, 4)
    base = base.double()
    fa = _randomised(LoraLinear(base, LoraConfig(rank=3, alpha=6.0, fa=True)))
    plain = LoraLinear(base, LoraConfig(rank=3, alpha=6.0))
    plain.lora_A, plain.lora_B = (
        torch.nn.Parameter(fa.lora_A.detach().clone()),
        (torch.nn.Parameter(fa.lora_B.detach().clone())),
    )
    plain.lora_A.requires_grad_(False)  # autograd's reference: the same math, A frozen
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = torch.randn(2, 3, 4, dtype=torch.float64)
    (fa(x1) * out).sum().backward()
    (plain(x2) * out).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fa.lora_B.grad, plain.lora_B.grad, rtol=1e-12, atol=1e-12)
    assert fa.lora_A.grad is None
    assert fa.weight.grad is None


def _saved_activation_bytes(layer: LoraLinear, x: torch.Tensor) -> tuple[int, list[tuple]]:
    """Bytes autograd keeps for backward that are not parameters, and their shapes."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        layer(x)
    acts = [t for t in kept if t.untyped_storage().data_ptr() not in params]
    return sum(t.numel() * t.element_size() for t in acts), [tuple(t.shape) for t in acts]


def test_lora_fa_keeps_only_the_r_wide_projection_of_its_input() -> None:
    n, d_in, rank = 32, 64, 4
    x = torch.randn(n, d_in, requires_grad=True)
    fa_bytes, fa_shapes = _saved_activation_bytes(
        LoraLinear(Conv1D(d_in, 3 * d_in), LoraConfig(rank=rank, fa=True)), x
    )
    lora_bytes, lora_shapes = _saved_activation_bytes(
        LoraLinear(Conv1D(d_in, 3 * d_in), LoraConfig(rank=rank)), x
    )
    assert fa_shapes == [(n, rank)]
    assert fa_bytes == n * rank * 4
    assert (n, d_in) in lora_shapes  # plain LoRA keeps x for A's gradient
    assert lora_bytes == n * (d_in + rank) * 4


def test_lora_fa_refuses_a_trainable_a() -> None:
    x, a, b = torch.randn(2, 3), torch.randn(1, 3, requires_grad=True), torch.randn(2, 1)
    with pytest.raises(AdapterError, match="keeps A frozen"):
        LoraFADelta.apply(x, a, b, 1.0)


@pytest.mark.parametrize(
    ("builder", "layers_per_block"), [(lambda: gpt2("tiny"), 4), (lambda: llama("llama-tiny"), 7)]
)
@pytest.mark.parametrize("fa", [False, True], ids=["lora", "lora-fa"])
def test_adapters_freeze_the_base_and_start_equal_to_it(builder, layers_per_block, fa) -> None:
    torch.manual_seed(0)
    model = builder()
    idx = torch.randint(0, 256, (2, 8))
    before = model(idx)
    wrapped = add_adapters(model, LoraConfig(rank=2, fa=fa))
    assert len(wrapped) == layers_per_block * 2  # every block linear of both blocks
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    assert all(n.endswith(".lora_B" if fa else (".lora_A", ".lora_B")) for n in trainable)
    assert len(trainable) == len(wrapped) * (1 if fa else 2)
    torch.testing.assert_close(model(idx), before, rtol=0, atol=0)  # B = 0: the base model


def test_targets_choose_layers_by_name_suffix_and_a_typo_is_refused() -> None:
    model = gpt2("tiny")
    assert add_adapters(model, LoraConfig(rank=2, targets=("c_attn",))) == [
        "transformer.h.0.attn.c_attn",
        "transformer.h.1.attn.c_attn",
    ]
    with pytest.raises(AdapterError, match="c_atn"):
        add_adapters(gpt2("tiny"), LoraConfig(rank=2, targets=("c_attn", "c_atn")))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2, "alpha": float("nan")}, "alpha"),
        ({"rank": 2, "alpha": -1.0}, "alpha"),
        ({"rank": 2, "targets": ("c_attn", "c_attn")}, "distinct"),
    ],
)
def test_lora_config_refuses_bad_values(fields, match) -> None:
    with pytest.raises(ConfigError, match=match):
        LoraConfig(**fields)


def test_alpha_defaults_to_the_rank() -> None:
    assert LoraConfig(rank=8).scaling == 1.0
    assert LoraConfig(rank=8, alpha=32).scaling == 4.0


def test_a_is_seeded_by_name_whatever_else_a_stage_materialises() -> None:
    with torch.device("meta"):
        whole, part = gpt2("tiny"), gpt2("tiny")
    for model in (whole, part):
        add_adapters(model, LoraConfig(rank=2))
    source = AdapterInit(SeededInit(whole.config, seed=5), seed=5)
    materialise(whole, source)
    block = part.transformer.h[1]  # one block alone, as a stage would hold it
    names = {n: f"transformer.h.1.{n}" for n, _ in block.named_parameters()}
    materialise(block, source, names)
    name = "transformer.h.1.mlp.c_fc.lora_A"
    assert torch.equal(block.mlp.c_fc.lora_A, whole.get_parameter(name))
    assert torch.equal(whole.get_parameter(name), init_a(5, name, (2, 64)))
    assert not torch.equal(init_a(6, name, (2, 64)), init_a(5, name, (2, 64)))
    assert not whole.transformer.h[0].mlp.c_fc.lora_B.any()
    assert block.mlp.c_fc.lora_A.requires_grad  # plain LoRA trains A


def test_adapted_model_traces_and_costs_lora_fa_lighter() -> None:
    with torch.device("meta"):
        models = {kind: gpt2("tiny") for kind in ("lora", "fa")}
    add_adapters(models["lora"], LoraConfig(rank=4))
    add_adapters(models["fa"], LoraConfig(rank=4, fa=True))
    graphs = {k: trace(m, (example_input(2, 16),)) for k, m in models.items()}
    lora_nodes = [n for n in graphs["lora"].nodes if "c_attn" in n.node_id]
    assert lora_nodes, [n.node_id for n in graphs["lora"].nodes]
    saved = {k: sum(n.peak_activation_bytes for n in g.nodes) for k, g in graphs.items()}
    # Each adapted layer keeps its input (2 x 16 rows) in LoRA, not in LoRA-FA.
    inputs = 2 * 16 * 4 * 2 * (64 + 64 + 64 + 256)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    assert saved["lora"] - saved["fa"] == inputs


def test_merged_model_computes_what_the_adapted_one_does() -> None:
    torch.manual_seed(1)
    for model in (gpt2("tiny"), llama("llama-tiny")):
        add_adapters(model, LoraConfig(rank=3, alpha=5.0))
        for module in model.modules():
            if isinstance(module, LoraLinear):
                _randomised(module, seed=len(module.extra_repr()))
        idx = torch.randint(0, 256, (2, 8))
        adapted = model(idx)
        merge_adapters(model)
        assert not any(isinstance(m, LoraLinear) for m in model.modules())
        torch.testing.assert_close(model(idx), adapted, rtol=1e-5, atol=1e-5)


def test_lora_fa_under_bf16_autocast_gives_fp32_gradients_as_lora_does() -> None:
    grads = {}
    for fa in (False, True):
        layer = _randomised(LoraLinear(Conv1D(16, 48), LoraConfig(rank=4, fa=fa)))
        layer.lora_A.requires_grad_(False)  # the same trainable set for both
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)  # (B, T, 48)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert x.grad.dtype == layer.lora_B.grad.dtype == torch.float32
        grads[fa] = (x.grad, layer.lora_B.grad)
    for ours, reference in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2)
