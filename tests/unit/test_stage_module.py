"""Cutting a traced model into stages changes nothing: same outputs, same gradients."""

import copy
import itertools
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.dag import OpGraph, trace
from fusionllm.dag.models import gpt2, llama, resnet

ATOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Case(NamedTuple):
    model: torch.nn.Module
    graph: OpGraph
    inputs: dict[str, torch.Tensor]
    reference: tuple  # the whole model's (outputs, gradients, output cotangents)


def _case(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Case:
    graph = trace(model, tuple(inputs.values()))
    return Case(model, graph, inputs, _whole_model(model, graph, inputs))


@pytest.fixture(scope="module")
def gpt2_case() -> Case:
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))  # (B, T)
    return _case(gpt2("tiny"), {"idx": idx})


@pytest.fixture(scope="module")
def llama_case() -> Case:
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))  # (B, T)
    return _case(llama("llama-tiny"), {"idx": idx})


@pytest.fixture(scope="module")
def resnet_case() -> Case:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))  # (B, C, H, W)
    return _case(resnet(18, num_classes=10), {"x": x})


def _stages(graph: OpGraph, cuts: list[int]) -> list[tuple[str, ...]]:
    bounds = [0, *sorted(set(cuts)), len(graph.node_ids)]
    return [graph.node_ids[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _as_leaf(value):
    """What a stage receives over the wire: a fresh tensor, a leaf of its own autograd graph."""
    if isinstance(value, tuple):
        return tuple(_as_leaf(v) for v in value)
    leaf = value.detach().clone()
    return leaf.requires_grad_(leaf.is_floating_point())


def _tensors(value) -> list[torch.Tensor]:
    return [t for v in value for t in _tensors(v)] if isinstance(value, tuple) else [value]


def _output_weights(graph: OpGraph, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fixed random cotangents: loss = sum_k <output_k, w_k>, so every output gets a gradient."""
    generator = torch.Generator().manual_seed(2)
    return {
        name: torch.randn(outputs[name].shape, generator=generator) for name in graph.output_names
    }


def _whole_model(model, graph, inputs):
    reference = copy.deepcopy(model)
    outputs = dict(zip(graph.output_names, [reference(*inputs.values())], strict=True))
    weights = _output_weights(graph, outputs)
    loss = sum((outputs[name] * weights[name]).sum() for name in graph.output_names)
    loss.backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    return outputs, grads, weights


def _pipeline(graph: OpGraph, stages, inputs, weights):
    """Forward stage by stage on separate copies, then backward stage by stage in reverse.

    Like the real pipeline: each stage owns its parameters, receives detached tensors and
    sends back the gradients of what it received; tied parameters' gradients are summed.
    """
    modules = [copy.deepcopy(graph.stage_module(ids)) for ids in stages]
    env: dict = dict(inputs)
    received, produced = [], []
    for ids, module in zip(stages, modules, strict=True):
        local = {name: _as_leaf(env[name]) for name in graph.stage_inputs(ids)}
        out = module(local)
        assert set(out) == set(graph.stage_outputs(ids))
        received.append(local)
        produced.append(out)
        env.update(
            {name: tuple(_tensors(v)) if isinstance(v, tuple) else v for name, v in out.items()}
        )
    grad_of: dict[str, list[torch.Tensor]] = {name: [weights[name]] for name in graph.output_names}
    for local, out in zip(reversed(received), reversed(produced), strict=True):
        roots, cotangents = [], []
        for name, value in out.items():
            if name not in grad_of:
                continue
            for tensor, grad in zip(_tensors(value), grad_of[name], strict=True):
                if tensor.requires_grad and grad is not None:
                    roots.append(tensor)
                    cotangents.append(grad)
        if roots:
            torch.autograd.backward(roots, cotangents)
        for name, value in local.items():
            grads = [t.grad if t.requires_grad else None for t in _tensors(value)]
            if name in grad_of:
                grad_of[name] = [
                    g if old is None else (old if g is None else old + g)
                    for old, g in zip(grad_of[name], grads, strict=True)
                ]
            else:
                grad_of[name] = grads
    canonical = graph.canonical_parameter_names()
    grads: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, p in module.named_parameters():  # a tie inside one stage is listed once
            if p.grad is not None:
                key = canonical[name]
                grads[key] = p.grad if key not in grads else grads[key] + p.grad
    return {name: env[name] for name in graph.output_names}, grads


def _check_cuts(case: Case, cuts: list[int]) -> None:
    _, graph, inputs, (ref_outputs, ref_grads, weights) = case
    outputs, grads = _pipeline(graph, _stages(graph, cuts), inputs, weights)
    for name in graph.output_names:
        torch.testing.assert_close(outputs[name], ref_outputs[name], atol=ATOL, rtol=0)
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        # fp32 sums in another order: error relative to the largest element (Llama-tiny's
        # embedding gradient reaches ~75, and whole model and stages are each ~4e-5 from fp64).
        atol = ATOL * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(grads[name], grad, atol=atol, rtol=0, msg=name)


# Llama: GQA, rotary and RMSNorm nodes and an untied head; GPT-2: a tied head.
_LANGUAGE_MODELS = pytest.mark.parametrize("case_name", ["gpt2_case", "llama_case"])


@_LANGUAGE_MODELS
def test_every_two_stage_cut_matches_the_whole_model(request, case_name) -> None:
    case = request.getfixturevalue(case_name)
    for cut in range(1, len(case.graph.node_ids)):
        _check_cuts(case, [cut])


@_LANGUAGE_MODELS
def test_one_node_per_stage_matches_the_whole_model(request, case_name) -> None:
    case = request.getfixturevalue(case_name)
    _check_cuts(case, list(range(1, len(case.graph.node_ids))))


@settings(max_examples=10, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10**6), min_size=2, max_size=7))
def test_gpt2_many_stages_match_the_whole_model(gpt2_case, cuts) -> None:
    n = len(gpt2_case.graph.node_ids)
    _check_cuts(gpt2_case, [1 + cut % (n - 1) for cut in cuts])


def test_resnet18_one_node_per_stage_matches_the_whole_model(resnet_case) -> None:
    """Every boundary is a cut at once: all values crossing any cut travel between stages."""
    graph = resnet_case.graph
    _check_cuts(resnet_case, list(range(1, len(graph.node_ids))))


def test_resnet18_stages_give_the_same_gradients(resnet_case) -> None:
    graph = resnet_case.graph
    ids = graph.node_ids
    # Inside a block (the skip crosses), right after a block, and four stages at once.
    _check_cuts(resnet_case, [ids.index("layer1_0_bn1")])
    n = len(ids)
    _check_cuts(resnet_case, [n // 4, n // 2, 3 * n // 4])


def test_one_stage_is_the_whole_model(gpt2_case) -> None:
    model, graph, inputs, _ = gpt2_case
    out = graph.stage_module(graph.node_ids)(inputs)
    assert list(out) == list(graph.output_names)
    torch.testing.assert_close(out["lm_head"], model(inputs["idx"]), atol=0, rtol=0)


def test_skip_connection_crosses_several_stages(gpt2_case) -> None:
    graph = gpt2_case.graph
    ids = graph.node_ids
    # Block 0's residual stream ("add": the embeddings) skips over the attention stage.
    ln_1, attn = ids.index("transformer_h_0_ln_1"), ids.index("scaled_dot_product_attention")
    first, middle, last = ids[: ln_1 + 1], ids[ln_1 + 1 : attn + 1], ids[attn + 1 :]
    assert "add" in graph.stage_outputs(first)
    assert "add" not in graph.stage_inputs(middle)
    assert "add" in graph.stage_inputs(last)
    _check_cuts(gpt2_case, [ln_1 + 1, attn + 1])


def test_stage_reads_only_what_it_needs_and_returns_what_others_need(gpt2_case) -> None:
    _, graph, inputs, _ = gpt2_case
    ids = graph.node_ids
    cut = ids.index("transformer_h_0_attn_c_attn") + 1
    first, second = ids[:cut], ids[cut:]
    assert graph.stage_inputs(first) == ("idx",)
    assert set(graph.stage_outputs(first)) == {"add", "transformer_h_0_attn_c_attn"}
    assert set(graph.stage_inputs(second)) == {"add", "transformer_h_0_attn_c_attn"}
    assert graph.stage_outputs(second) == ("lm_head",)
    out = graph.stage_module(first)(inputs)
    assert set(out) == {"add", "transformer_h_0_attn_c_attn"}
    assert out["transformer_h_0_attn_c_attn"].shape == (2, 16, 192)


def test_stage_ids_may_come_in_any_order(gpt2_case) -> None:
    _, graph, inputs, _ = gpt2_case
    ids = list(graph.node_ids[:10])
    forward = graph.stage_module(ids)(inputs)
    backward = graph.stage_module(reversed(ids))(inputs)
    assert forward.keys() == backward.keys()
    for name in forward:
        torch.testing.assert_close(forward[name], backward[name], atol=0, rtol=0)


def test_stage_module_refuses_bad_node_sets(gpt2_case) -> None:
    graph = gpt2_case.graph
    with pytest.raises(ValueError, match="at least one node"):
        graph.stage_module([])
    with pytest.raises(ValueError, match="unknown node ids"):
        graph.stage_module(["transformer_wte", "no_such_node"])
    with pytest.raises(ValueError, match="given twice"):
        graph.stage_module(["transformer_wte", "transformer_wte"])


def test_stage_parameters_keep_the_model_names(gpt2_case) -> None:
    model, graph = gpt2_case.model, gpt2_case.graph
    model_state = model.state_dict()
    ids = graph.node_ids
    seen: set[str] = set()
    for stage in _stages(graph, [len(ids) // 3, 2 * len(ids) // 3]):
        state = graph.stage_module(stage).state_dict()
        assert set(state) <= set(model_state)
        for name, tensor in state.items():
            assert tensor is model_state[name] or torch.equal(tensor, model_state[name])
        seen |= set(state)
    assert seen == set(model_state)


def test_tied_embedding_is_in_both_stages_that_use_it(gpt2_case) -> None:
    graph = gpt2_case.graph
    assert graph.shared_parameters() == {"transformer.wte.weight": ("transformer_wte", "lm_head")}
    ids = graph.node_ids
    first = graph.stage_module(ids[:5])
    last = graph.stage_module(ids[-3:])
    assert "transformer.wte.weight" in dict(first.named_parameters())
    assert "lm_head.weight" in dict(last.named_parameters())
    assert graph.canonical_parameter_names()["lm_head.weight"] == "transformer.wte.weight"


def test_model_output_rebuilds_the_return_value(resnet_case) -> None:
    model, graph, inputs, _ = resnet_case
    model.eval()
    try:
        env = dict(inputs)
        for stage in _stages(graph, [20, 40]):
            env.update(graph.stage_module(stage)(env))
        torch.testing.assert_close(graph.model_output(env), model(inputs["x"]), atol=ATOL, rtol=0)
    finally:
        model.train()
