"""One pipeline stage's compute: forward and backward per micro-batch, optimizer step. No network.

A ``StageWorker`` owns a deep copy of its stage module and an AdamW over its parameters.
``forward`` keeps the autograd state of a micro-batch keyed by (step, micro-batch) until
``backward`` gets the gradient of what the forward sent on, and returns the gradients of what
it received. The last stage turns the logits into the loss itself: cross-entropy averaged over
the micro-batch's tokens and divided by the number of micro-batches M, so the gradients
accumulated over a step equal those of the mean loss over the whole batch.

The cross-stage parts of a step are the caller's: summing a tied parameter's gradients over
the stages that hold it (``tied_grad`` / ``set_tied_grad``), averaging over data-parallel
replicas (``flat_grads`` / ``set_flat_grads``) and the global gradient norm
(``local_grad_sq_norm``, then ``clip_and_step``).
"""

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.models.lora import AdapterInit
from fusionllm.dag.models.materialise import UNSET, WeightSource, materialise
from fusionllm.dag.models.registry import language_model_loss
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.loss_scale import unscale_or_zero

logger = get_logger(__name__)

Key = tuple[int, int]  # (step, micro-batch)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # 0 or inf: no clipping

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError(
                f"need lr > 0, weight_decay >= 0, max_grad_norm >= 0; got {self.lr}, "
                f"{self.weight_decay}, {self.max_grad_norm}"
            )


def build_adamw(
    parameters: Iterable[torch.nn.Parameter], config: OptimizerConfig, *, fused: bool = True
) -> torch.optim.AdamW:
    """AdamW as every trainer here builds it (a stage, and the one-process reference run).

    Fused where the device has the kernel (``Compute.fused_optimizer``): one kernel over all
    tensors instead of a loop of small ops per tensor (measured on GPT-2 tiny, 2 CPU cores:
    0.18 ms a step vs 0.87). The update is elementwise, so a stage's parameters get the same
    update as the same parameters in the whole model."""
    return torch.optim.AdamW(
        list(parameters),
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
        fused=fused,
    )


class _NoParameters:
    """The optimizer of a stage that holds no parameters: nothing to step or zero."""

    def __init__(self) -> None:
        self.state: dict = {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What torch.nn.utils.clip_grad_norm_ multiplies the gradients by."""
    if max_norm <= 0 or math.isinf(max_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def _make_real(
    module: torch.nn.Module, layout: PipelineLayout, stage: int, weights: WeightSource | None
) -> None:
    """Give the stage module's meta parameters real tensors from ``weights``, in place."""
    if any(p.is_meta for p in module.parameters()):
        if weights is None:
            raise PipelineError(
                f"stage {stage}'s model was built on the meta device and no weights were given"
            )
        materialise(module, weights, layout.graph.canonical_parameter_names())


@dataclass
class _Saved:
    leaves: dict[str, torch.Tensor]  # what the stage received, as autograd leaves
    roots: dict[str, torch.Tensor]  # what it sent on (or the loss), still in the graph


class StageWorker:
    """Stage ``stage`` of ``layout``: its own parameters, optimizer and in-flight micro-batches."""

    def __init__(
        self,
        layout: PipelineLayout,
        stage: int,
        *,
        optimizer: OptimizerConfig,
        micro_batches: int,
        compute: Compute | None = None,
        weights: WeightSource | None = None,
        deferred: bool = False,
    ) -> None:
        """``weights``: where the stage's parameters come from when ``layout`` was traced from
        a model on the meta device (only this stage's are made real). ``deferred``: leave them
        on meta until ``make_real`` (a plan's start decides whether they are initialised or
        every one of them is loaded from a checkpoint's state)."""
        if not 0 <= stage < layout.num_stages:
            raise ValueError(f"stage must be in [0, {layout.num_stages}), got {stage}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.layout = layout
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == layout.num_stages - 1
        self.micro_batches = micro_batches
        self.compute = compute if compute is not None else Compute()
        self.device = self.compute.device
        self.config = optimizer
        self._weights = weights
        self._real = False
        self.module = copy.deepcopy(layout.stage_module(stage))  # meta tensors: nothing allocated
        self.parameters = self._named()  # on meta until make_real
        self.optimizer: torch.optim.Optimizer | _NoParameters = _NoParameters()
        if not deferred:
            self.make_real()
        self.loss_scale = 1.0  # fp16: the step's scale (loss_scale.py), set by the runner
        self.in_link = layout.links[stage - 1] if not self.is_first else None
        self.out_link = layout.links[stage] if not self.is_last else None
        self._saved: dict[Key, _Saved] = {}

    def make_real(self, *, initialise: bool = True) -> None:
        """Give the stage's parameters memory on our device, once: their initial values from
        the run's weights, or (``initialise=False``: a checkpoint's state is imported into
        every one of them next) uninitialised memory, so a resumed stage never runs the init
        nor reads a weights folder only to overwrite it."""
        if self._real:
            return
        _make_real(self.module, self.layout, self.stage, self._source(initialise))
        # float32 master weights on the device, whatever the precision (autocast casts).
        self.module = self.module.to(self.device)
        self.module.train()
        self.parameters = self._named()
        # A cut may leave a stage only parameter-free ops (a GELU between two Linears: the
        # compute-balanced baseline seated a 0.2-core host so); torch's AdamW refuses none.
        self.optimizer = (
            build_adamw(self.parameters.values(), self.config, fused=self.compute.fused_optimizer)
            if self.parameters
            else _NoParameters()
        )
        self._real = True

    def _source(self, initialise: bool) -> WeightSource | None:
        # A fine-tune's checkpoint holds only what trains: its frozen base is read again and
        # LoRA-FA's frozen A drawn again (the trained adapters' init is small, then replaced).
        if initialise or isinstance(self._weights, AdapterInit):
            return self._weights
        return UNSET

    def _named(self) -> dict[str, torch.nn.Parameter]:
        canonical = self.layout.stage_parameter_names(self.stage)
        # named_parameters lists a parameter tied inside the stage once: one entry per tensor.
        # Frozen ones (a fine-tune's base) are not ours to train: not in canonical.
        return {canonical[n]: p for n, p in self.module.named_parameters() if n in canonical}

    # ----- per micro-batch -------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._saved)

    def forward(
        self,
        step: int,
        micro_batch: int,
        inputs: dict[str, torch.Tensor],
        targets: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the stage on one micro-batch.

        inputs: the model inputs (first stage) or the incoming link's values, on any device
        (moved to ours). Returns the outgoing link's values (detached, on our device), or on
        the last stage {"loss": the micro-batch's mean loss}, a detached 0-d float32 tensor on
        our device (unscaled, for reporting; not read here, so no device sync per micro-batch);
        ``targets`` (B, T) is needed there.
        """
        key = (step, micro_batch)
        if key in self._saved:
            raise PipelineError(f"stage {self.stage}: forward of {key} ran twice")
        leaves = {
            name: value.detach()
            .to(self.device, non_blocking=True)
            .requires_grad_(value.is_floating_point())
            for name, value in inputs.items()
        }
        values: dict[str, torch.Tensor] = dict(leaves)
        with self.compute.autocast():
            values.update(self.module(leaves))
            if self.is_last:
                if targets is None:
                    raise PipelineError("the last stage needs the targets to compute the loss")
                (output,) = self.layout.graph.output_names
                logits = values[output]  # (B, T, V)
                targets = targets.to(self.device, non_blocking=True)  # (B, T)
                loss = language_model_loss(logits, targets)
        if self.is_last:
            loss = loss.float()  # autocast runs cross_entropy in float32; say so anyway
            root = loss / self.micro_batches
            if self.loss_scale != 1.0:
                root = root * self.loss_scale
            self._saved[key] = _Saved(leaves, {"loss": root})
            return {"loss": loss.detach()}
        assert self.out_link is not None
        roots = {name: values[name] for name in self.out_link.names}
        self._saved[key] = _Saved(leaves, roots)
        return {name: value.detach() for name, value in roots.items()}

    @torch.no_grad()
    def evaluate(
        self, inputs: dict[str, torch.Tensor], targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor] | float:
        """``forward`` without autograd and without keeping anything: the outgoing link's
        values (on our device), or on the last stage the mean loss over ``targets`` (B, T).
        Inputs may be on any device; the run's precision applies, as in ``forward``."""
        values = {name: v.to(self.device, non_blocking=True) for name, v in inputs.items()}
        self.module.eval()  # dropout off (the presets have none; a user's model may)
        try:
            with self.compute.autocast():
                values.update(self.module(values))
        finally:
            self.module.train()
        if not self.is_last:
            assert self.out_link is not None
            return {name: values[name] for name in self.out_link.names}
        if targets is None:
            raise PipelineError("the last stage needs the targets to compute the loss")
        (output,) = self.layout.graph.output_names
        logits = values[output]  # (B, T, V)
        targets = targets.to(self.device, non_blocking=True)  # (B, T)
        return float(language_model_loss(logits.float(), targets))

    def backward(
        self, step: int, micro_batch: int, output_grads: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Backward of one micro-batch; returns the gradients of the incoming link's values.

        Parameter gradients accumulate in ``.grad`` over the micro-batches of a step. The first
        stage returns {} (its inputs are token ids).
        """
        saved = self._saved.pop((step, micro_batch), None)
        if saved is None:
            raise PipelineError(
                f"stage {self.stage}: backward of {(step, micro_batch)} before its forward"
            )
        if self.is_last:
            roots, grads = [saved.roots["loss"]], [None]
        else:
            if output_grads is None:
                raise PipelineError(f"stage {self.stage} needs the gradients of its outputs")
            roots, grads = [], []
            for name, root in saved.roots.items():
                if root.requires_grad:
                    roots.append(root)
                    # The wire is float32 on the CPU; autocast may have made a bf16 root.
                    grads.append(output_grads[name].to(root.device, root.dtype, non_blocking=True))
        if roots:
            torch.autograd.backward(roots, grads)
        if self.in_link is None:
            return {}
        return {
            name: saved.leaves[name].grad
            if saved.leaves[name].grad is not None
            else torch.zeros_like(saved.leaves[name])
            for name in self.in_link.names
        }

    def drop(self, step: int) -> None:
        """Forget every micro-batch of ``step`` still in flight (an aborted step)."""
        for key in [k for k in self._saved if k[0] == step]:
            del self._saved[key]

    # ----- per step ---------------------------------------------------------------------------

    def grad(self, name: str) -> torch.Tensor:
        """The accumulated gradient of a parameter (zeros if it got none this step)."""
        p = self.parameters[name]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def set_grad(self, name: str, grad: torch.Tensor) -> None:
        p = self.parameters[name]
        if grad.shape != p.shape:
            raise ValueError(f"{name}: gradient of shape {tuple(grad.shape)} for {tuple(p.shape)}")
        p.grad = grad.to(device=p.device, dtype=p.dtype, copy=True)

    def flat_grads(self) -> torch.Tensor:
        """Every parameter's gradient, flattened and concatenated in ``parameters`` order."""
        return torch.cat([self.grad(name).reshape(-1) for name in self.parameters])

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        sizes = [p.numel() for p in self.parameters.values()]
        if tuple(flat.shape) != (sum(sizes),):
            raise ValueError(f"expected {sum(sizes)} gradient values, got {tuple(flat.shape)}")
        for (name, p), part in zip(self.parameters.items(), torch.split(flat, sizes), strict=True):
            self.set_grad(name, part.view(p.shape))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters.values())

    def unscale_or_zero(self, scale: float) -> bool:
        """fp16: divide this step's gradients by ``scale``, or zero them all and return True
        if any overflowed (loss_scale.unscale_or_zero)."""
        grads = [p.grad for p in self.parameters.values() if p.grad is not None]
        return unscale_or_zero(grads, scale)

    def skip_step(self) -> None:
        """Drop this step's gradients without an update (an overflow somewhere in the run)."""
        if self._saved:
            raise PipelineError(
                f"stage {self.stage}: {len(self._saved)} micro-batches still in flight at the step"
            )
        self.optimizer.zero_grad(set_to_none=True)

    def local_grad_sq_norm(self, skip: frozenset[str] = frozenset()) -> float:
        """Sum of squared gradient entries, leaving out ``skip`` (tied copies counted elsewhere)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name in self.parameters:
            if name not in skip:
                total += self.grad(name).double().pow(2).sum()
        return float(total)

    def clip_and_step(self, global_norm: float) -> float:
        """Scale the gradients for the global norm, step AdamW, zero the gradients.

        Returns the clip coefficient used.
        """
        if self._saved:
            raise PipelineError(
                f"stage {self.stage}: {len(self._saved)} micro-batches still in flight at the step"
            )
        coefficient = clip_coefficient(global_norm, self.config.max_grad_norm)
        if coefficient < 1.0:
            for p in self.parameters.values():
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return coefficient

    def export_state(self, name: str) -> torch.Tensor:
        """One parameter with its AdamW state, flat: (3 * numel + 1,) float32 =
        [value, exp_avg, exp_avg_sq, step]; moments are zeros before the first step."""
        p = self.parameters[name]
        state = self.optimizer.state.get(p, {})
        zeros = torch.zeros_like(p)
        step = float(state["step"]) if "step" in state else 0.0
        parts = (p.detach(), state.get("exp_avg", zeros), state.get("exp_avg_sq", zeros))
        flat = [x.reshape(-1).to("cpu", torch.float32) for x in parts]
        return torch.cat([*flat, torch.tensor([step], dtype=torch.float32)])

    def import_state(self, name: str, flat: torch.Tensor) -> None:
        """Take a parameter and its AdamW state from ``export_state``'s layout."""
        p = self.parameters[name]
        n = p.numel()
        if tuple(flat.shape) != (3 * n + 1,):
            raise ValueError(f"{name}: state of shape {tuple(flat.shape)}, expected {(3 * n + 1,)}")
        value, exp_avg, exp_avg_sq = (flat[i * n : (i + 1) * n].view(p.shape) for i in range(3))
        with torch.no_grad():
            p.copy_(value)
        step = float(flat[-1])
        if step > 0:
            # The fused step wants its state where the parameter is, the step count included.
            self.optimizer.state[p] = {
                "step": torch.tensor(step, dtype=torch.float32, device=p.device),
                "exp_avg": exp_avg.to(p.device, p.dtype).clone(),
                "exp_avg_sq": exp_avg_sq.to(p.device, p.dtype).clone(),
            }
        else:
            self.optimizer.state.pop(p, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under their canonical names (detached copies, on the CPU)."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.parameters.items()}
