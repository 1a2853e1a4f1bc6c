"""trace(): node ids, costs per operator, errors that say where tracing broke, determinism."""

import json
import logging
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from torch import nn
from torch.nn import functional

from fusionllm.common.errors import FusionError
from fusionllm.dag import GraphCosts, OpGraph, TraceFailure, trace
from fusionllm.dag.flops import OpCost, leaf_module
from fusionllm.dag.models import gpt2, resnet

F32 = 4


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # (B, 4)


def test_linear_flops_bytes_and_edges() -> None:
    graph = trace(TwoLinear(), torch.randn(5, 8))
    assert graph.node_ids == ("fc1", "relu", "fc2")
    assert graph.input_names == ("x",)
    assert graph.output_names == ("fc2",)
    fc1, relu, fc2 = graph.nodes
    assert fc1.inputs == ("x",)
    assert relu.inputs == ("fc1",)
    assert fc2.inputs == ("relu",)
    assert fc1.forward_flops == 2 * 8 * 16 * 5
    # Data needs no gradient: fc1's backward is the weight gradient only.
    assert fc1.backward_flops == fc1.forward_flops
    assert fc2.forward_flops == 2 * 16 * 4 * 5
    assert fc2.backward_flops == 2 * fc2.forward_flops  # input grad + weight grad
    assert fc1.param_bytes == (8 * 16 + 16) * F32
    assert fc1.output_bytes == 5 * 16 * F32
    assert fc2.output_bytes == 5 * 4 * F32
    assert fc1.peak_activation_bytes == 5 * 8 * F32  # keeps x for the weight gradient
    assert relu.peak_activation_bytes == 5 * 16 * F32  # keeps its output
    assert graph.costs().input_bytes == {"x": 5 * 8 * F32}


def test_frozen_weights_cost_only_the_input_gradient() -> None:
    model = TwoLinear()
    model.fc2.requires_grad_(False)
    fc2 = trace(model, torch.randn(5, 8)).node("fc2")
    assert fc2.backward_flops == fc2.forward_flops
    assert fc2.peak_activation_bytes == 0  # no weight gradient, so its input is not kept
    model.requires_grad_(False)
    graph = trace(model, torch.randn(5, 8))
    assert all(node.backward_flops == 0 for node in graph.nodes)
    assert all(node.peak_activation_bytes == 0 for node in graph.nodes)


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 8))
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1, groups=1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = functional.linear(x, self.weight)  # (B, 6)
        g = torch.matmul(h.unsqueeze(-1), h.unsqueeze(-2))  # (B, 6, 6)
        y = self.conv(img)  # (B, 4, H, W)
        return g, y


def test_function_calls_and_parameters_read_directly() -> None:
    x, img = torch.randn(2, 8, requires_grad=True), torch.randn(2, 3, 5, 5)
    graph = trace(Functional(), (x, img))
    assert graph.input_names == ("x", "img")
    linear = graph.node("linear")
    assert linear.op == "linear"
    assert linear.inputs == ("x",)  # the weight is a parameter, not an edge
    assert linear.param_bytes == 6 * 8 * F32
    assert linear.forward_flops == 2 * 8 * 6 * 2
    assert linear.backward_flops == 2 * linear.forward_flops  # x requires grad here
    matmul = graph.node("matmul")
    assert matmul.forward_flops == 2 * 1 * (2 * 6 * 6)
    assert matmul.backward_flops == 2 * matmul.forward_flops
    conv = graph.node("conv")
    assert conv.forward_flops == 2 * (3 * 3 * 3) * (2 * 4 * 5 * 5)
    assert conv.backward_flops == conv.forward_flops  # the image needs no gradient
    assert graph.output_names == ("matmul", "conv")
    assert graph.shared_parameters() == {}


def test_attention_flops() -> None:
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    b, h, length, e = 2, 3, 7, 4
    q = torch.randn(b, h, length, e, requires_grad=True)
    node = trace(Attention(), (q, q, q)).node("scaled_dot_product_attention")
    scores = b * h * length * length
    assert node.forward_flops == 4 * scores * e + 5 * scores
    assert node.backward_flops == 8 * scores * e + 5 * scores
    assert node.peak_activation_bytes == 4 * q.numel() * F32 + b * h * length * F32


def test_unknown_op_counts_elementwise_and_says_so(caplog) -> None:
    class Cumulative(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=-1)

    with caplog.at_level(logging.DEBUG, logger="fusionllm"):
        node = trace(Cumulative(), torch.randn(3, 5)).node("cumsum")
    assert node.forward_flops == 15
    assert "no cost rule for cumsum" in caplog.text


def test_leaf_module_is_one_node_with_its_own_rule() -> None:
    @leaf_module(lambda call: OpCost(forward_flops=7 * call.out_numel))
    class Opaque(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # would break tracing if fx looked inside
                return x * 2
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Opaque()

        def forward(self, x):
            return self.inner(x) + 1

    with pytest.raises(TraceFailure, match=r"at node 'inner'.*meta=False"):
        trace(Outer(), torch.randn(4, 3))  # its `if` needs values, meta tensors have none
    graph = trace(Outer(), torch.randn(4, 3), meta=False)
    assert graph.node_ids == ("inner", "add")
    assert graph.node("inner").op == "Opaque"
    assert graph.node("inner").forward_flops == 7 * 12


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gates = nn.Sequential(nn.ReLU(), Gate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gates(self.proj(x))


def test_untraceable_model_names_the_module_and_line() -> None:
    with pytest.raises(TraceFailure) as info:
        trace(Gated(), torch.randn(2, 4))
    message = str(info.value)
    assert "gates.1 (Gate)" in message
    assert "if x.sum() > 0:" in message
    assert "control flow" in message
    assert isinstance(info.value, FusionError)


def test_example_inputs_must_match_forward() -> None:
    with pytest.raises(TraceFailure, match=r"forward takes 2 inputs \['x', 'img'\], got 1"):
        trace(Functional(), torch.randn(2, 8))
    graph = trace(Functional(), {"img": torch.randn(1, 3, 4, 4), "x": torch.randn(1, 8)})
    assert graph.input_names == ("x", "img")
    with pytest.raises(TraceFailure, match="shape propagation failed at node 'linear'"):
        trace(Functional(), (torch.randn(2, 5), torch.randn(1, 3, 4, 4)))


def test_gpt2_graph_shape() -> None:
    graph = trace(gpt2("tiny"), torch.zeros(2, 16, dtype=torch.long))
    assert isinstance(graph, OpGraph)
    assert graph.input_names == ("idx",)
    assert graph.output_names == ("lm_head",)
    assert graph.node_ids[0] == "transformer_wte"
    assert graph.target("transformer_h_1_attn_c_attn") == "transformer.h.1.attn.c_attn"
    assert graph.node("transformer_h_1_attn_c_attn").op == "Conv1D"
    assert graph.value_meta("lm_head").shape == (2, 16, 256)
    assert graph.shared_parameters() == {"transformer.wte.weight": ("transformer_wte", "lm_head")}
    assert graph.node_parameters("lm_head") == ("transformer.wte.weight",)
    assert isinstance(graph.costs(), GraphCosts)
    assert len(graph.costs().cut_bytes()) == len(graph.nodes) + 1


def test_gpt2_small_flops_follow_the_6nt_rule() -> None:
    with torch.device("meta"):
        model = gpt2("small")
        idx = torch.zeros(1, 128, dtype=torch.long)
    graph = trace(model, idx)
    tokens = idx.numel()
    forward = sum(node.forward_flops for node in graph.nodes)
    backward = sum(node.backward_flops for node in graph.nodes)
    n_params = model.num_parameters()
    assert n_params == 124_439_808
    # Matmuls over all weights (the tied embedding as lm_head) plus a little attention.
    assert 1.0 < forward / (2 * n_params * tokens) < 1.05
    assert 1.0 < (forward + backward) / (6 * n_params * tokens) < 1.05
    c = model.config.n_embd
    block_cut = graph.costs().cut_bytes()[graph.node_ids.index("transformer_h_1_ln_1")]
    assert block_cut == tokens * c * F32  # between blocks only the residual stream crosses


def test_resnet_flops_match_published_macs() -> None:
    with torch.device("meta"):
        model = resnet(50)
        x = torch.zeros(1, 3, 224, 224)
    graph = trace(model, x)
    macs = sum(node.forward_flops for node in graph.nodes if node.op in ("Conv2d", "Linear")) / 2
    assert 4.08e9 < macs < 4.13e9  # torchvision lists 4.09 GMACs
    assert sum(node.param_bytes for node in graph.nodes) == 25_557_032 * F32
    assert graph.input_names == ("x",)
    assert graph.output_names == ("fc",)


def test_tracing_leaves_the_model_untouched() -> None:
    model = resnet(18, num_classes=10)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(2, 3, 32, 32)
    on_meta = trace(model, x)
    for_real = trace(model, x, meta=False)
    assert on_meta.costs() == for_real.costs()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def _fingerprint(graph: OpGraph) -> str:
    return json.dumps([asdict(node) for node in graph.nodes])


_FINGERPRINT_SCRIPT = """
import json, torch
from dataclasses import asdict
from fusionllm.dag import trace
from fusionllm.dag.models import gpt2, resnet
torch.manual_seed(123)
idx, img = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 3, 32, 32)
graphs = [trace(gpt2("tiny"), idx), trace(resnet(18), img)]
print(json.dumps([json.dumps([asdict(n) for n in g.nodes]) for g in graphs]))
"""


def test_node_ids_and_costs_are_deterministic_across_instances_and_processes() -> None:
    idx, img = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 3, 32, 32)
    here = [_fingerprint(trace(gpt2("tiny"), idx)), _fingerprint(trace(resnet(18), img))]
    again = [_fingerprint(trace(gpt2("tiny"), idx)), _fingerprint(trace(resnet(18), img))]
    assert here == again
    result = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(result.stdout) == here
