"""Per-operator cost rules: forward/backward FLOPs and the activation bytes kept for backward.

A rule sees one traced call (``OpCall``: the module, if any, and the shapes of its tensor
arguments and outputs) and returns an ``OpCost``. Rules are looked up by module type (through
its MRO), then by function object, then by function/method name; an op with no rule is costed
as one FLOP per output element and logged at debug.

Conventions (also what the planner's numbers mean):
- A multiply-add is 2 FLOPs. Bias adds and other O(output) terms next to a matmul are ignored.
- Backward FLOPs count only the gradients autograd will compute: a matmul costs its forward
  once per operand that requires grad (input grad, weight grad), so frozen weights halve it
  and a first layer fed with data (no input grad) halves it too. Ops whose output needs no
  grad cost nothing backward.
- ``saved_bytes`` estimates the activations autograd keeps from this op until its backward
  (parameters are not activations and are not counted). Summed over a stage's ops it is the
  activation memory one in-flight micro-batch holds at the end of that stage's forward, which
  is when training memory peaks. Each op counts what it saves on its own, so a tensor saved by
  two ops counts twice: an overestimate, the safe side for memory.
- Attention is costed as the full L x S score matrix, causal or not, like
  torch.utils.flop_counter; its memory as a fused kernel's (q, k, v, output, log-sum-exp),
  not the math path's score matrix.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fusionllm.common.logs import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Shape and type of one tensor value seen during shape propagation."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    is_param: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor, *, is_param: bool = False) -> "TensorMeta":
        return cls(
            shape=tuple(int(d) for d in tensor.shape),
            dtype=tensor.dtype,
            requires_grad=bool(tensor.requires_grad),
            is_param=is_param,
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class OpCall:
    """What a cost rule sees of one traced call.

    args: the tensor arguments in call order (positional, then keyword), parameters included
    and flagged; for a module call, ``params`` holds the module's own parameters.
    """

    name: str
    module: nn.Module | None
    args: tuple[TensorMeta, ...]
    params: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    @property
    def activations(self) -> tuple[TensorMeta, ...]:
        return tuple(arg for arg in self.args if not arg.is_param)

    @property
    def output(self) -> TensorMeta | None:
        return self.outputs[0] if self.outputs else None

    @property
    def out_numel(self) -> int:
        return sum(out.numel for out in self.outputs)

    @property
    def needs_grad(self) -> bool:
        return any(out.requires_grad for out in self.outputs)

    @property
    def trainable_params(self) -> bool:
        return any(p.requires_grad for p in self.params) or any(
            arg.requires_grad for arg in self.args if arg.is_param
        )


@dataclass(frozen=True, kw_only=True)
class OpCost:
    forward_flops: int = 0
    backward_flops: int = 0
    saved_bytes: int = 0


Rule = Callable[[OpCall], OpCost]

FREE = OpCost()


def zero_cost(call: OpCall) -> OpCost:
    """Views, reshapes, indexing, copies: no arithmetic and nothing saved for backward."""
    return FREE


def _matmul(call: OpCall, a: TensorMeta, b: TensorMeta) -> OpCost:
    """out = a @ b (batched or not); a's last dim is the contraction."""
    out = call.output
    if out is None:
        return FREE
    fwd = 2 * (a.shape[-1] if a.shape else 1) * out.numel
    a_grad, b_grad = a.requires_grad, b.requires_grad
    bwd = fwd * (int(a_grad) + int(b_grad))
    # grad of a needs b, grad of b needs a; parameters are not activation memory.
    saved = (0 if a.is_param or not b_grad else a.nbytes) + (
        0 if b.is_param or not a_grad else b.nbytes
    )
    return OpCost(forward_flops=fwd, backward_flops=bwd, saved_bytes=saved)


def linear_cost(call: OpCall) -> OpCost:
    """nn.Linear, F.linear and HF's Conv1D: 2*in*out per token forward."""
    out = call.output
    if out is None or not call.args:
        return FREE
    x = call.args[0]
    weight = TensorMeta(
        shape=(x.shape[-1], out.shape[-1] if out.shape else 1),
        dtype=x.dtype,
        requires_grad=call.trainable_params,
        is_param=True,
    )
    if len(call.args) > 1 and not call.args[1].is_param:
        weight = call.args[1]  # F.linear with a computed weight
    return _matmul(call, x, weight)


def matmul_cost(call: OpCall) -> OpCost:
    """matmul/mm/bmm and, with the first argument as the addend, addmm/baddbmm/addbmm."""
    if len(call.args) < 2:
        return FREE
    return _matmul(call, call.args[-2], call.args[-1])


def conv_cost(call: OpCall) -> OpCost:
    """ConvNd: 2 * (C_in / groups) * prod(kernel) per output element."""
    out = call.output
    if out is None or not call.args:
        return FREE
    if call.module is not None:
        weight_shape = tuple(call.module.weight.shape)
    else:
        weight_shape = call.args[1].shape
    per_output = math.prod(weight_shape[1:])  # (C_in / groups) * kernel
    fwd = 2 * per_output * out.numel
    x = call.args[0]
    trainable = call.trainable_params
    bwd = fwd * (int(x.requires_grad) + int(trainable))
    return OpCost(forward_flops=fwd, backward_flops=bwd, saved_bytes=x.nbytes if trainable else 0)


def attention_cost(call: OpCall) -> OpCost:
    """scaled_dot_product_attention(q (..., L, E), k (..., S, E), v (..., S, Ev))."""
    if len(call.args) < 3 or call.output is None:
        return FREE
    q, k, v = call.args[:3]
    length, source = q.shape[-2], k.shape[-2]
    heads = q.numel // (length * q.shape[-1]) if length and q.shape[-1] else 0  # batch * heads
    scores = heads * length * source
    matmuls = 2 * scores * q.shape[-1] + 2 * scores * v.shape[-1]
    fwd = matmuls + 5 * scores  # + scale, mask, softmax
    if not call.needs_grad:
        return OpCost(forward_flops=fwd)
    lse = heads * length * 4  # fp32 log-sum-exp per query row
    saved = q.nbytes + k.nbytes + v.nbytes + call.output.nbytes + lse
    return OpCost(forward_flops=fwd, backward_flops=2 * matmuls + 5 * scores, saved_bytes=saved)


def embedding_cost(call: OpCall) -> OpCost:
    """A gather forward; backward scatter-adds into the table (only if it trains)."""
    if not call.trainable_params or not call.args:
        return FREE
    return OpCost(backward_flops=call.out_numel, saved_bytes=call.args[0].nbytes)


def elementwise(forward: float, backward: float, *, saves: str) -> Rule:
    """Rule for an op costing ``forward``/``backward`` FLOPs per output element.

    saves: what autograd keeps: "input" (first tensor argument), "inputs" (all activations),
    "output", "mask" (one byte per output element) or "none".
    """
    if saves not in ("input", "inputs", "output", "mask", "none"):
        raise ValueError(f"unknown saves={saves!r}")

    def rule(call: OpCall) -> OpCost:
        numel = call.out_numel
        fwd = math.ceil(forward * numel)
        if not call.needs_grad:
            return OpCost(forward_flops=fwd)
        acts = call.activations
        saved = {
            "input": acts[0].nbytes if acts else 0,
            "inputs": sum(a.nbytes for a in acts),
            "output": sum(o.nbytes for o in call.outputs),
            "mask": numel,
            "none": 0,
        }[saves]
        return OpCost(
            forward_flops=fwd, backward_flops=math.ceil(backward * numel), saved_bytes=saved
        )

    return rule


def reduction_cost(call: OpCall) -> OpCost:
    """sum/mean/pooling: about one FLOP per input element each way."""
    numel = sum(a.numel for a in call.activations)
    if not call.needs_grad:
        return OpCost(forward_flops=numel)
    return OpCost(forward_flops=numel, backward_flops=numel)


def max_pool_cost(call: OpCall) -> OpCost:
    """Reads each input element about once; keeps the argmax indices (int64) for backward."""
    numel = sum(a.numel for a in call.activations)
    if not call.needs_grad:
        return OpCost(forward_flops=numel)
    return OpCost(forward_flops=numel, backward_flops=numel, saved_bytes=8 * call.out_numel)


_NORM = elementwise(5, 10, saves="input")  # mean, variance, normalise, scale, shift
_UNKNOWN = elementwise(1, 1, saves="output")

_MODULE_RULES: dict[type, Rule] = {
    nn.Linear: linear_cost,
    nn.Bilinear: linear_cost,
    nn.Conv1d: conv_cost,
    nn.Conv2d: conv_cost,
    nn.Conv3d: conv_cost,
    nn.Embedding: embedding_cost,
    nn.LayerNorm: _NORM,
    nn.GroupNorm: _NORM,
    nn.modules.batchnorm._BatchNorm: _NORM,
    nn.ReLU: elementwise(1, 1, saves="output"),
    nn.GELU: elementwise(8, 8, saves="input"),
    nn.SiLU: elementwise(4, 4, saves="input"),
    nn.Tanh: elementwise(4, 2, saves="output"),
    nn.Sigmoid: elementwise(4, 2, saves="output"),
    nn.Softmax: elementwise(5, 4, saves="output"),
    nn.LogSoftmax: elementwise(5, 4, saves="output"),
    nn.Dropout: elementwise(2, 1, saves="mask"),
    nn.MaxPool1d: max_pool_cost,
    nn.MaxPool2d: max_pool_cost,
    nn.MaxPool3d: max_pool_cost,
    nn.AvgPool2d: reduction_cost,
    nn.AdaptiveAvgPool1d: reduction_cost,
    nn.AdaptiveAvgPool2d: reduction_cost,
    nn.Identity: zero_cost,
    nn.Flatten: zero_cost,
    nn.Unflatten: zero_cost,
}

# Functions (call_function) and tensor methods (call_method) share these names.
if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    _MODULE_RULES[nn.RMSNorm] = elementwise(4, 8, saves="input")

_NAME_RULES: dict[str, Rule] = {
    "linear": linear_cost,
    "matmul": matmul_cost,
    "mm": matmul_cost,
    "bmm": matmul_cost,
    "addmm": matmul_cost,
    "baddbmm": matmul_cost,
    "addbmm": matmul_cost,
    "einsum": _UNKNOWN,
    "conv1d": conv_cost,
    "conv2d": conv_cost,
    "conv3d": conv_cost,
    "scaled_dot_product_attention": attention_cost,
    "embedding": embedding_cost,
    "layer_norm": _NORM,
    "group_norm": _NORM,
    "batch_norm": _NORM,
    "rms_norm": elementwise(4, 8, saves="input"),
    "add": elementwise(1, 0, saves="none"),
    "iadd": elementwise(1, 0, saves="none"),
    "sub": elementwise(1, 0, saves="none"),
    "neg": elementwise(1, 0, saves="none"),
    "mul": elementwise(1, 2, saves="inputs"),
    "imul": elementwise(1, 2, saves="inputs"),
    "truediv": elementwise(1, 3, saves="inputs"),
    "div": elementwise(1, 3, saves="inputs"),
    "pow": elementwise(2, 3, saves="inputs"),
    "sqrt": elementwise(1, 2, saves="output"),
    "rsqrt": elementwise(2, 3, saves="output"),
    "exp": elementwise(1, 1, saves="output"),
    "relu": elementwise(1, 1, saves="output"),
    "gelu": elementwise(8, 8, saves="input"),
    "silu": elementwise(4, 4, saves="input"),
    "tanh": elementwise(4, 2, saves="output"),
    "sigmoid": elementwise(4, 2, saves="output"),
    "softmax": elementwise(5, 4, saves="output"),
    "log_softmax": elementwise(5, 4, saves="output"),
    "dropout": elementwise(2, 1, saves="mask"),
    "cross_entropy": elementwise(5, 4, saves="input"),
    "sum": reduction_cost,
    "mean": reduction_cost,
    "adaptive_avg_pool2d": reduction_cost,
    "avg_pool2d": reduction_cost,
    "max_pool2d": max_pool_cost,
    "arange": zero_cost,
}
_FREE_NAMES = (
    "getitem getattr size dim view reshape transpose permute flatten unflatten split chunk "
    "contiguous expand expand_as squeeze unsqueeze t narrow select to type_as float half bfloat16 "
    "detach clone cat stack repeat zeros ones zeros_like ones_like full"
)
for _name in _FREE_NAMES.split():
    _NAME_RULES.setdefault(_name, zero_cost)

_FUNCTION_RULES: dict[Callable, Rule] = {}
_LEAF_TYPES: set[type] = set()


def leaf_module(rule: Rule) -> Callable[[type], type]:
    """Class decorator: trace this module as one node (like nn.Linear) costed by ``rule``."""

    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"leaf_module decorates nn.Module subclasses, got {cls!r}")
        _MODULE_RULES[cls] = rule
        _LEAF_TYPES.add(cls)
        return cls

    return register


def function_cost(rule: Rule) -> Callable[[Callable], Callable]:
    """Decorator: cost calls of this (fx-wrapped) function with ``rule`` instead of by name."""

    def register(fn: Callable) -> Callable:
        _FUNCTION_RULES[fn] = rule
        return fn

    return register


def is_registered_leaf(module: nn.Module) -> bool:
    return any(cls in _LEAF_TYPES for cls in type(module).__mro__)


def rule_for(*, module: nn.Module | None, target: object) -> tuple[Rule, bool]:
    """The rule for a call and whether it is a known op (False: the fallback was used)."""
    if module is not None:
        for cls in type(module).__mro__:
            if cls in _MODULE_RULES:
                return _MODULE_RULES[cls], True
        return _UNKNOWN, False
    if callable(target) and target in _FUNCTION_RULES:
        return _FUNCTION_RULES[target], True
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    name = name.strip("_") if name.startswith("__") else name  # operator.__add__ -> add
    if name in _NAME_RULES:
        return _NAME_RULES[name], True
    return _UNKNOWN, False


def op_cost(call: OpCall, *, target: object) -> OpCost:
    """Cost of one call; unknown ops count one FLOP per output element (logged at debug)."""
    rule, known = rule_for(module=call.module, target=target)
    if not known:
        logger.debug("no cost rule for %s; counting it elementwise on its output", call.name)
    return rule(call)
