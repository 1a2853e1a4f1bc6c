"""``trace``: nn.Module -> OpGraph, by torch.fx symbolic tracing plus shape propagation.

One OpGraph node per fx call (a leaf module such as nn.Linear, a function, a tensor method);
``get_attr`` nodes (parameters read directly) are folded into the calls that read them, since
parameters live with a stage and never travel. Node ids are fx node names, which depend only
on the module's code and structure, so the same model gives the same ids in every process.

Shapes come from running the traced graph once with every tensor (parameters, buffers, inputs)
swapped for a meta tensor: no arithmetic and no allocation, so tracing GPT-2 xl costs about
what GPT-2 tiny does. Costs follow the rules in flops.py; ``peak_activation_bytes`` is what
the op keeps for backward (see flops.py). ``param_bytes`` counts a node's parameters in full,
so a parameter several nodes use (GPT-2's tied embedding) counts at each: right for stages
that each hold a copy, twice within one stage (``OpGraph.shared_parameters`` lists them).
"""

import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dag.flops import OpCall, TensorMeta, is_registered_leaf, op_cost
from fusionllm.dag.graph import OpNode
from fusionllm.dag.opgraph import OpGraph, ValueMeta

logger = get_logger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)


class TraceFailure(FusionError):  # noqa: N818 (the name the API promises)
    """torch.fx could not trace the model, or the traced graph failed on the example inputs."""


class _Tracer(fx.Tracer):
    """fx's tracer plus fusionllm's leaf modules and a record of where tracing broke."""

    def __init__(self) -> None:
        super().__init__()
        self._module_stack: list[str] = []
        self.failed_in: list[str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_registered_leaf(m) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            path = self.path_of_module(m)
        except NameError:
            path = "<module not in the model>"
        self._module_stack.append(f"{path or '<root>'} ({type(m).__name__})")
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # innermost module first: that is where it broke
                self.failed_in = list(self._module_stack)
            raise
        finally:
            self._module_stack.pop()


def _user_frame(exc: BaseException) -> str:
    """file:line and source of the innermost frame outside torch, i.e. the model's own code."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__
    ]
    if not frames:
        return "<inside torch>"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: `{(frame.line or '').strip()}`"


def symbolic_trace(module: nn.Module) -> fx.GraphModule:
    """fx-trace ``module``; a failure raises TraceFailure naming the module and line that broke."""
    tracer = _Tracer()
    try:
        graph = tracer.trace(module)
    except Exception as exc:
        where = (
            " > ".join(tracer.failed_in)
            if tracer.failed_in
            else f"<root> ({type(module).__name__})"
        )
        raise TraceFailure(
            f"torch.fx cannot trace {type(module).__name__}: it broke in module {where}, "
            f"at {_user_frame(exc)}: {type(exc).__name__}: {exc}. Data-dependent control flow "
            "(if/for on tensor values) and Python use of tensor sizes are the usual causes; "
            "decorate helper functions with torch.fx.wrap or the module with "
            "fusionllm.dag.flops.leaf_module to keep them opaque."
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _meta_of(value: Any, *, is_param: bool = False) -> ValueMeta:
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value, is_param=is_param)
    if isinstance(value, tuple | list):
        return tuple(_meta_of(item) for item in value)
    return None


def _tensor_metas(meta: ValueMeta) -> tuple[TensorMeta, ...]:
    if isinstance(meta, TensorMeta):
        return (meta,)
    if isinstance(meta, tuple):
        return tuple(t for item in meta for t in _tensor_metas(item))
    return ()


class _ShapeRecorder(fx.Interpreter):
    """Runs the graph once and keeps each node's output shapes (not the values)."""

    def __init__(self, gm: fx.GraphModule, *, meta: bool) -> None:
        super().__init__(gm)
        self.metas: dict[str, ValueMeta] = {}
        self._hint = (
            " (shapes were propagated on meta tensors, which hold no values; "
            "trace(..., meta=False) runs the example inputs for real)"
            if meta
            else ""
        )

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise TraceFailure(
                f"shape propagation failed at node {n.name!r} ({n.op} {_target_name(n)}): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{self._hint}"
            ) from exc
        self.metas[n.name] = _meta_of(result, is_param=isinstance(result, nn.Parameter))
        return result


def _target_name(node: fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    return getattr(node.target, "__name__", repr(node.target))


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else meta


class _Runner(nn.Module):
    """Lets torch.func.functional_call swap the graph's tensors for meta ones while it runs."""

    def __init__(self, gm: fx.GraphModule, *, meta: bool) -> None:
        super().__init__()
        self.gm = gm
        self.meta = meta

    def forward(self, *inputs: Any) -> dict[str, ValueMeta]:
        recorder = _ShapeRecorder(self.gm, meta=self.meta)
        recorder.run(*inputs)
        return recorder.metas


def _propagate(gm: fx.GraphModule, inputs: Sequence[Any], *, meta: bool) -> dict[str, ValueMeta]:
    runner = _Runner(gm, meta=meta)
    if meta:
        # Meta tensors carry shapes, dtypes and requires_grad but no data: nothing is computed
        # or allocated, whatever the model's size.
        swap, named = (
            _on_meta,
            [
                *runner.named_parameters(remove_duplicate=False),
                *runner.named_buffers(remove_duplicate=False),
            ],
        )
        inputs = [_on_meta(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    else:
        # Buffers are cloned so a real run leaves e.g. BatchNorm's running stats untouched.
        swap, named = torch.clone, list(runner.named_buffers(remove_duplicate=False))
    swapped: dict[int, torch.Tensor] = {}  # tied tensors map to one replacement
    state = {}
    for name, tensor in named:
        if id(tensor) not in swapped:
            swapped[id(tensor)] = swap(tensor)
        state[name] = swapped[id(tensor)]
    return torch.func.functional_call(runner, state, tuple(inputs), strict=False)


def _ordered_inputs(gm: fx.GraphModule, example_inputs: Any) -> list[Any]:
    """Example inputs as a list in placeholder order, from a tensor, a sequence or a mapping."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        missing = [name for name in names if name not in example_inputs]
        extra = sorted(set(example_inputs) - set(names))
        if missing or extra:
            raise TraceFailure(f"forward takes {names}; example inputs miss {missing}, add {extra}")
        return [example_inputs[name] for name in names]
    example_inputs = list(example_inputs)
    if len(example_inputs) != len(names):
        raise TraceFailure(
            f"forward takes {len(names)} inputs {names}, got {len(example_inputs)} example inputs"
        )
    return example_inputs


def _op_name(node: fx.Node, module: nn.Module | None) -> str:
    if module is not None:
        return type(module).__name__
    return _target_name(node)


def _op_node(
    node: fx.Node,
    module_called: nn.Module | None,
    gm: fx.GraphModule,
    metas: dict[str, ValueMeta],
    getattr_nodes: set[str],
    canonical: dict[str, str],
) -> tuple[OpNode, tuple[str, ...]]:
    """One call node's OpNode (costs from its argument, parameter and output metas) and the
    canonical names of the parameters it uses."""
    params = _node_parameters(node, module_called, gm)
    unique = {id(p): p for _, p in params}
    names = tuple(dict.fromkeys(canonical.get(name, name) for name, _ in params))
    call = OpCall(
        name=node.name,
        module=module_called,
        args=tuple(
            t
            for arg in _call_order(node)
            for t in _tensor_metas(_arg_meta(metas[arg.name], arg, getattr_nodes))
        ),
        params=tuple(TensorMeta.of(p, is_param=True) for p in unique.values()),
        outputs=_tensor_metas(metas[node.name]),
    )
    cost = op_cost(call, target=node.target)
    op_node = OpNode(
        node_id=node.name,
        op=_op_name(node, module_called),
        inputs=tuple(a.name for a in node.all_input_nodes if a.name not in getattr_nodes),
        forward_flops=cost.forward_flops,
        backward_flops=cost.backward_flops,
        param_bytes=sum(p.numel() * p.element_size() for p in unique.values()),
        output_bytes=sum(t.nbytes for t in call.outputs),
        peak_activation_bytes=cost.saved_bytes,
    )
    return op_node, names


def trace(module: nn.Module, example_inputs: Any, *, meta: bool = True) -> OpGraph:
    """Trace ``module`` into an OpGraph costed for ``example_inputs``.

    example_inputs: one tensor, a sequence in forward's argument order, or a mapping from
    argument name to tensor. Costs are for this batch (FLOPs and bytes scale with it).
    meta: propagate shapes on meta tensors (default: nothing is computed or allocated). With
    False the graph runs for real on the example inputs, for ops that have no meta kernel.
    The returned graph shares parameters with ``module``.
    """
    gm = symbolic_trace(module)
    inputs = _ordered_inputs(gm, example_inputs)
    metas = _propagate(gm, inputs, meta=meta)

    modules = dict(gm.named_modules())
    canonical = _canonical_parameter_names(module)
    getattr_nodes: set[str] = set()
    input_bytes: dict[str, int] = {}
    nodes: list[OpNode] = []
    node_params: dict[str, tuple[str, ...]] = {}
    targets: dict[str, str] = {}
    output_names: tuple[str, ...] = ()

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            input_bytes[node.name] = sum(t.nbytes for t in _tensor_metas(metas[node.name]))
            continue
        if node.op == "get_attr":
            getattr_nodes.add(node.name)
            continue
        if node.op == "output":
            output_names = _output_names(node, getattr_nodes)
            continue
        module_called = modules[node.target] if node.op == "call_module" else None
        op_node, names = _op_node(node, module_called, gm, metas, getattr_nodes, canonical)
        nodes.append(op_node)
        node_params[node.name] = names
        targets[node.name] = _target_name(node)

    graph = OpGraph(
        graph_module=gm,
        nodes=tuple(nodes),
        input_bytes=input_bytes,
        output_names=output_names,
        node_parameters=node_params,
        canonical_names=canonical,
        targets=targets,
        value_metas=metas,
    )
    logger.debug(
        "traced %s: %d nodes, %.3g forward FLOPs",
        type(module).__name__,
        len(nodes),
        sum(n.forward_flops for n in nodes),
    )
    return graph


def _call_order(node: fx.Node) -> list[fx.Node]:
    """The node's arguments in call order, repeats kept (x * x has two operands)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _arg_meta(meta: ValueMeta, arg: fx.Node, getattr_nodes: set[str]) -> ValueMeta:
    """get_attr values are parameters (or buffers): flag them so rules don't count them as data."""
    if arg.name in getattr_nodes and isinstance(meta, TensorMeta):
        return TensorMeta(
            shape=meta.shape, dtype=meta.dtype, requires_grad=meta.requires_grad, is_param=True
        )
    return meta


def _node_parameters(
    node: fx.Node, module: nn.Module | None, gm: fx.GraphModule
) -> list[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) pairs a call uses: a leaf module's own, or those it reads."""
    if module is not None:
        return [
            (f"{node.target}.{name}", p)
            for name, p in module.named_parameters(remove_duplicate=False)
        ]
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _fetch_attr(gm, arg.target)
            if isinstance(value, nn.Parameter):
                found.append((arg.target, value))
    return found


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _output_names(node: fx.Node, getattr_nodes: set[str]) -> tuple[str, ...]:
    names: list[str] = []
    fx.node.map_arg(node.args[0], lambda n: names.append(n.name))
    bad = [name for name in names if name in getattr_nodes]
    if bad:
        raise TraceFailure(
            f"the model returns parameters/buffers {bad} directly; return activations"
        )
    return tuple(dict.fromkeys(names))


def _canonical_parameter_names(module: nn.Module) -> dict[str, str]:
    """Every name of every parameter -> its first name (tied parameters have several)."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(p), name)
    return names
