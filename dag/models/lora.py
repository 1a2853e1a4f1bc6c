"""Low-rank adapters (LoRA, LoRA-FA) on a model's linear layers: the base frozen, A and B trained.

``add_adapters(model, config)`` swaps each target layer (GPT-2's Conv1D ``c_attn``/``c_proj``/
``c_fc``, Llama's ``q/k/v/o/gate/up/down_proj``) for a ``LoraLinear`` holding the same
``weight`` and ``bias`` (frozen, under the same names, so a Hugging Face folder still loads by
name) plus ``lora_A`` (r, in) and ``lora_B`` (out, r):

    y = base(x) + (x A^T) B^T * alpha / r

B starts at zero (the adapted model starts equal to the base); A is drawn per parameter from
the run's seed (``AdapterInit``), so every holder of a stage draws the same A. With LoRA-FA
(Zhang et al., 2023) A stays frozen at that draw and only B trains; ``LoraFADelta`` then keeps
only ``x A^T`` (r wide) for backward instead of ``x`` (in wide), which is where the memory goes.

``LoraLinear`` is one OP-DAG node (a leaf module costed by ``lora_cost``), so the adapted model
traces, cuts and plans like the zoo's models. The PEFT layout in and out is ``lora_io.py``.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.flops import OpCall, OpCost, leaf_module
from fusionllm.dag.models.gpt2 import GPT2, Conv1D
from fusionllm.dag.models.llama import Llama
from fusionllm.dag.models.materialise import WeightSource, parameter_seed

logger = get_logger(__name__)

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")

# Every linear layer of a block; the head and embeddings stay as they are.
DEFAULT_TARGETS: dict[type, tuple[str, ...]] = {
    GPT2: ("c_attn", "c_proj", "c_fc"),
    Llama: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


class AdapterError(ConfigError):
    """Adapters that do not fit the model, or a LoRA-FA A asked to train."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int
    alpha: float = 0.0  # 0: the rank (scaling 1)
    fa: bool = False  # LoRA-FA: A frozen at its seeded init, only B trains
    targets: tuple[str, ...] = ()  # module name suffixes, as PEFT's target_modules; (): all

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or not 1 <= self.rank <= 4096:
            raise ConfigError(f"LoRA rank must be an integer in [1, 4096], got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha):
            raise ConfigError(f"LoRA alpha must be a finite number, got {self.alpha!r}")
        if self.alpha < 0:
            raise ConfigError(f"LoRA alpha must be >= 0 (0: the rank), got {self.alpha}")
        if self.alpha == 0:
            object.__setattr__(self, "alpha", float(self.rank))
        bad = [t for t in self.targets if not isinstance(t, str) or not t or " " in t]
        if bad or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets must be distinct module names, got {self.targets}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraFADelta(torch.autograd.Function):
    """(x A^T) B^T * scaling for x (N, in), A (r, in) frozen, B (out, r): keeps x A^T, not x.

    Backward: dx = (g B) A * scaling, dB = g^T (x A^T) * scaling; A gets none (it is frozen,
    and its gradient would need x). Under autocast the forward's matmuls run in the autocast
    dtype; the backward computes in the dtype ``x A^T`` was kept in and returns each gradient
    in its input's dtype."""

    @staticmethod
    def forward(ctx, x, a, b, scaling: float):
        if a.requires_grad:
            raise AdapterError("LoRA-FA keeps A frozen; it cannot give A a gradient")
        ax = x @ a.t()  # (N, r): all that backward needs of x
        ctx.save_for_backward(ax, a, b)
        ctx.scaling = scaling
        ctx.x_dtype = x.dtype
        return (ax @ b.t()) * scaling  # (N, out)

    @staticmethod
    def backward(ctx, grad):
        ax, a, b = ctx.saved_tensors
        g = grad.to(ax.dtype)  # (N, out)
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = ((g @ b.to(ax.dtype)) @ a.to(ax.dtype) * ctx.scaling).to(ctx.x_dtype)  # (N, in)
        if ctx.needs_input_grad[2]:
            db = ((g.t() @ ax) * ctx.scaling).to(b.dtype)  # (out, r)
        return dx, None, db, None


def lora_cost(call: OpCall) -> OpCost:
    """A frozen matmul plus the adapter's two thin ones. Saved for backward: x A^T (r wide),
    and x itself for plain LoRA (A's gradient); the frozen base saves nothing."""
    module, out = call.module, call.output
    if not isinstance(module, LoraLinear) or out is None or not call.args:
        return OpCost()
    x = call.args[0]
    rows = x.numel // max(module.in_features, 1)
    n_in, n_out, r = module.in_features, module.out_features, module.rank
    forward = 2 * rows * (n_in * n_out + r * (n_in + n_out))
    if not call.needs_grad:
        return OpCost(forward_flops=forward)
    backward = 2 * rows * r * n_out  # dB
    if x.requires_grad:
        backward += 2 * rows * (n_in * n_out + r * (n_in + n_out))  # dx through both paths
    saved = rows * r * x.dtype.itemsize
    if not module.fa:
        backward += 2 * rows * r * n_in  # dA
        saved += x.nbytes
    return OpCost(forward_flops=forward, backward_flops=backward, saved_bytes=saved)


@leaf_module(lora_cost)
class LoraLinear(nn.Module):
    """A frozen linear layer (``weight``, ``bias``: the base's own tensors) with an adapter.

    ``fan_in_fan_out``: the weight is stored (in, out), as GPT-2's Conv1D stores it; else
    (out, in), as nn.Linear."""

    def __init__(self, base: nn.Module, config: LoraConfig) -> None:
        super().__init__()
        self.fan_in_fan_out = isinstance(base, Conv1D)
        if not self.fan_in_fan_out and not isinstance(base, nn.Linear):
            raise AdapterError(f"LoRA wraps nn.Linear or Conv1D, not {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.scaling, self.fa = config.rank, config.scaling, config.fa
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(
            torch.zeros(self.rank, self.in_features, **like), requires_grad=not self.fa
        )
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank, **like))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (N, in)
        weight = self.weight if self.fan_in_fan_out else self.weight.t()  # (in, out)
        bias = self.bias
        y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)  # (N, out)
        if self.fa:
            delta = LoraFADelta.apply(flat, self.lora_A, self.lora_B, self.scaling)
        else:
            delta = (flat @ self.lora_A.t()) @ self.lora_B.t() * self.scaling  # (N, out)
        return (y + delta).reshape(*x.shape[:-1], self.out_features)

    def delta_weight(self) -> torch.Tensor:
        """What merging adds to ``weight``, in its layout: (B A) * scaling, (out, in) or its
        transpose for a Conv1D."""
        delta = (self.lora_B @ self.lora_A) * self.scaling  # (out, in)
        return delta.t() if self.fan_in_fan_out else delta

    def extra_repr(self) -> str:
        kind = "LoRA-FA" if self.fa else "LoRA"
        return f"{self.in_features} -> {self.out_features}, {kind} rank {self.rank}"


def targets_of(model: nn.Module, config: LoraConfig) -> tuple[str, ...]:
    """The configured targets, or the architecture's defaults."""
    if config.targets:
        return config.targets
    for kind, names in DEFAULT_TARGETS.items():
        if isinstance(model, kind):
            return names
    raise AdapterError(f"no default LoRA targets for {type(model).__name__}; give targets")


def add_adapters(model: nn.Module, config: LoraConfig) -> list[str]:
    """Freeze every parameter of ``model`` and wrap each target layer in a ``LoraLinear``, in
    place (on meta too: the adapters are made real with the rest). Returns the wrapped module
    names. A target that names no layer is an error (a typo would otherwise train nothing)."""
    targets = targets_of(model, config)
    for param in model.parameters():
        param.requires_grad_(False)
    chosen = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | Conv1D)
        and any(name == t or name.endswith("." + t) for t in targets)
    ]
    matched = {t for t in targets for n in chosen if n == t or n.endswith("." + t)}
    if not chosen or matched != set(targets):
        raise AdapterError(
            f"LoRA targets {sorted(set(targets) - matched)} name no linear layer of "
            f"{type(model).__name__}"
        )
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoraLinear(getattr(parent, attr), config))
    logger.debug("LoRA rank %d on %d layers (%s)", config.rank, len(chosen), ",".join(targets))
    return chosen


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor (A and B, trained or not) by parameter name, detached CPU copies."""
    return {
        name: p.detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if is_adapter(name)
    }


def init_a(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A's seeded draw: uniform in +-1/sqrt(in), as PEFT's kaiming-uniform(a=sqrt(5)) gives."""
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class AdapterInit:
    """A ``WeightSource`` for an adapted model: A seeded by name, B zeros, the rest from
    ``base`` (a folder's weights or a preset's seeded init)."""

    def __init__(self, base: WeightSource, seed: int) -> None:
        self.base = base
        self.seed = seed

    def tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        out = self.base.tensors({n: s for n, s in shapes.items() if not is_adapter(n)})
        for name, shape in shapes.items():
            if name.endswith(".lora_A"):
                out[name] = init_a(self.seed, name, shape)
            elif name.endswith(".lora_B"):
                out[name] = torch.zeros(shape)
        return out


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every ``LoraLinear`` back into a plain layer with ``weight + delta``, in place;
    returns ``model`` (now the registry's plain architecture, loadable by name)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoraLinear):
            continue
        parent_name, _, attr = name.rpartition(".")
        if module.fan_in_fan_out:
            plain: nn.Module = Conv1D(module.in_features, module.out_features)
        else:
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        with torch.no_grad():
            plain.weight = nn.Parameter(module.weight + module.delta_weight())
            if module.bias is not None:
                plain.bias = nn.Parameter(module.bias.detach().clone())
        setattr(model.get_submodule(parent_name), attr, plain)
    return model


def with_frozen_a(
    shapes: Mapping[str, tuple[int, ...]], trained: Mapping[str, torch.Tensor], seed: int
) -> dict[str, torch.Tensor]:
    """Every adapter tensor of ``shapes`` (``adapter_shapes``): the trained ones, and each A a
    LoRA-FA run never trained (so no stage stored it) drawn again from the run's seed."""
    out = dict(trained)
    for name, shape in shapes.items():
        if name not in out and name.endswith(".lora_A"):
            out[name] = init_a(seed, name, shape)
    return out
