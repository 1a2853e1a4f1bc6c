"""What a training run is: model, data, batch, optimizer, stages, replicas, link compression.

One kw-only dataclass, validated on construction, serialisable to JSON so a launcher can
hand the same run to every stage process. ``build_model`` and ``build_layout`` make the model,
graph and layout the same way in every process (per-parameter seeded init, same trace), which
is what lets stages that never exchange parameters start from identical weights; a stage
process builds the model on meta and makes only its own parameters real (``weight_source``).
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import FOLDER, PRECISIONS, RunSpec
from fusionllm.dag import OpGraph, trace
from fusionllm.dag.models import read_config, registry
from fusionllm.dag.models.lora import AdapterInit, LoraConfig, add_adapters
from fusionllm.dag.models.materialise import FolderWeights, SeededInit, WeightSource, materialise
from fusionllm.dag.models.pretrained import check_layers
from fusionllm.node.pipeline.data import BatchConfig, TokenDataset
from fusionllm.node.pipeline.layout import PipelineLayout, balanced_cuts
from fusionllm.node.pipeline.stage import OptimizerConfig

if TYPE_CHECKING:
    from fusionllm.dag.planner import Plan

logger = get_logger(__name__)

GRADIENT_CODECS = frozenset({"topk", "ternary"})
_REAL_TRACE_MAX_WORK = 1 << 33  # parameters x tokens: ~1e10 multiply-adds, ~1 s of one core


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "tiny"  # a preset of the model registry (dag/models/registry.py), or FOLDER
    model_dir: str | None = None  # model FOLDER: the Hugging Face folder it starts from
    stages: int = 2
    cuts: tuple[int, ...] | None = None  # node positions; None: balanced by forward FLOPs
    replicas: tuple[int, ...] | None = None  # per stage; None: one each
    micro_batches: int = 4
    batch_size: int = 4  # sequences per micro-batch
    seq_len: int = 32
    steps: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # 0 or inf: no clipping
    seed: int = 0
    # A uint16/uint32 token file or a ``fusionllm prepare`` directory; None: stdlib bytes.
    data_path: str | None = None
    data_dtype: str | None = None  # a token file's (default uint16); a directory's manifest says
    # The data's (256: the stdlib's bytes); loading the data checks its ids against it. Set
    # without data_path where only the model's shapes are wanted.
    vocab_size: int = 256
    stdlib_bytes: int = 2 << 20
    # Top-k ratio per link (len stages - 1) and direction; 1.0 sends dense float32. A ratio
    # is a byte budget: that of top-k at the ratio. Activations spend it as
    # ``activation_codec`` picks (a ternary code while it fits); gradients, with error
    # feedback, on ``gradient_codec``: "topk", or "ternary" (``budget_codec(ternary=True)``).
    activation_ratios: tuple[float, ...] = ()
    gradient_ratios: tuple[float, ...] = ()
    gradient_codec: str = "topk"
    eval_every: int = 0  # steps; 0: no validation (evaluation.py)
    # Per link and direction, where the ratio is 1.0: True sends the dense values as 2-byte
    # floats (``HALF_WIRE``), what a plan's "fp16" link is counted at. () : all float32.
    activation_halves: tuple[bool, ...] = ()
    gradient_halves: tuple[bool, ...] = ()
    precision: str = "fp32"  # every stage's autocast dtype (RunSpec.precision)
    # Low-rank adapters (RunSpec.lora_*): rank 0 trains every parameter.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_fa: bool = False
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "cuts", "replicas", "activation_ratios", "gradient_ratios", "betas",
            "activation_halves", "gradient_halves", "lora_targets",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        for name in ("stages", "micro_batches", "batch_size", "seq_len", "steps", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuts is not None and len(self.cuts) != self.stages - 1:
            raise ConfigError(f"{self.stages} stages need {self.stages - 1} cuts, got {self.cuts}")
        if self.replicas is not None:
            if len(self.replicas) != self.stages or min(self.replicas) < 1:
                raise ConfigError(
                    f"replicas must be {self.stages} counts >= 1, got {self.replicas}"
                )
            if max(self.replicas) > self.micro_batches:
                raise ConfigError(
                    f"{max(self.replicas)} replicas need at least as many micro-batches, "
                    f"got {self.micro_batches}"
                )
        for name in ("activation_ratios", "gradient_ratios"):
            ratios = getattr(self, name)
            if ratios and len(ratios) != self.stages - 1:
                raise ConfigError(f"{name} needs {self.stages - 1} entries, got {len(ratios)}")
            if any(not 0.0 < r <= 1.0 for r in ratios):
                raise ConfigError(f"{name} must be in (0, 1], got {ratios}")
        for name in ("activation_halves", "gradient_halves"):
            halves = getattr(self, name)
            if halves and len(halves) != self.stages - 1:
                raise ConfigError(f"{name} needs {self.stages - 1} entries, got {len(halves)}")
            if any(not isinstance(h, bool) for h in halves):
                raise ConfigError(f"{name} must be booleans, got {halves}")
        if self.gradient_codec not in GRADIENT_CODECS:
            raise ConfigError(
                f"gradient_codec must be one of {sorted(GRADIENT_CODECS)}, "
                f"got {self.gradient_codec!r}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not self.lr > 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError(
                f"need lr > 0, weight_decay >= 0, max_grad_norm >= 0; got {self.lr}, "
                f"{self.weight_decay}, {self.max_grad_norm}"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas}")
        _ = self.lora  # validated there

    @property
    def lora(self) -> LoraConfig | None:
        """The adapters this run trains, or None (every parameter trains)."""
        if not self.lora_rank:
            if self.lora_alpha or self.lora_fa or self.lora_targets:
                raise ConfigError("LoRA settings (alpha, fa, targets) need lora_rank >= 1")
            return None
        return LoraConfig(
            rank=self.lora_rank, alpha=self.lora_alpha, fa=self.lora_fa, targets=self.lora_targets
        )

    @property
    def batch(self) -> BatchConfig:
        return BatchConfig(
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            seed=self.seed,
            micro_batches=self.micro_batches,
        )

    @property
    def optimizer(self) -> OptimizerConfig:
        return OptimizerConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=self.betas,
            max_grad_norm=self.max_grad_norm,
        )

    @property
    def stage_replicas(self) -> tuple[int, ...]:
        return self.replicas if self.replicas is not None else (1,) * self.stages

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.batch_size * self.seq_len

    def activation_ratio(self, link: int) -> float:
        return self.activation_ratios[link] if self.activation_ratios else 1.0

    def gradient_ratio(self, link: int) -> float:
        return self.gradient_ratios[link] if self.gradient_ratios else 1.0

    def activation_half(self, link: int) -> bool:
        return bool(self.activation_halves) and self.activation_halves[link]

    def gradient_half(self, link: int) -> bool:
        return bool(self.gradient_halves) and self.gradient_halves[link]

    @classmethod
    def for_run(
        cls,
        run: RunSpec,
        *,
        cuts: tuple[int, ...] | None,
        replicas: tuple[int, ...] | None,
        stages: int | None = None,
        steps: int | None = None,
        activation_ratios: tuple[float, ...] = (),
        gradient_ratios: tuple[float, ...] = (),
        data_path: str | None = None,
        data_dtype: str | None = None,
        activation_halves: tuple[bool, ...] = (),
        gradient_halves: tuple[bool, ...] = (),
    ) -> "TrainConfig":
        """The run spec on a given layout (cuts, replicas per stage, link ratios), with this
        node's copy of the data (the spec names it by digest, not by path). ``cuts`` None:
        ``stages`` balanced by forward FLOPs. ``steps`` None: the run's, at least one (a
        node's own loop decides when a run without end stops)."""
        if (cuts is None) == (stages is None):
            raise ConfigError(f"give cuts or stages, not both or neither: {cuts}, {stages}")
        return cls(
            model=run.model,
            stages=len(cuts) + 1 if cuts is not None else stages,
            cuts=cuts,
            replicas=replicas,
            micro_batches=run.micro_batches,
            batch_size=run.micro_batch_size,
            seq_len=run.seq_len,
            steps=max(run.steps, 1) if steps is None else steps,
            lr=run.lr,
            weight_decay=run.weight_decay,
            betas=run.betas,
            max_grad_norm=run.max_grad_norm,
            seed=run.seed,
            model_dir=run.model_dir,
            stdlib_bytes=run.stdlib_bytes,
            data_path=data_path,
            data_dtype=data_dtype,
            vocab_size=run.vocab_size,
            activation_ratios=activation_ratios,
            gradient_ratios=gradient_ratios,
            activation_halves=activation_halves,
            gradient_halves=gradient_halves,
            gradient_codec=run.gradient_codec,
            eval_every=run.eval_every,
            precision=run.precision,
            lora_rank=run.lora_rank,
            lora_alpha=run.lora_alpha,
            lora_fa=run.lora_fa,
            lora_targets=run.lora_targets,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ConfigError("a TrainConfig must be a JSON object")
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ConfigError(f"bad TrainConfig: {exc}") from exc


def model_config(config: TrainConfig) -> Any:
    """The run's model: its registry preset with the run's vocabulary, or its folder's."""
    if config.model != FOLDER:
        return registry.preset_config(config.model, vocab_size=config.vocab_size)
    if config.model_dir is None:
        raise ConfigError(f"model {FOLDER!r} needs model_dir, the Hugging Face folder")
    folder_config = read_config(config.model_dir)
    if folder_config.vocab_size < config.vocab_size:
        raise ConfigError(
            f"{config.model_dir} has a vocabulary of {folder_config.vocab_size}; the data's "
            f"token ids go up to {config.vocab_size - 1}"
        )
    return folder_config


def build_model(config: TrainConfig, *, meta: bool = False) -> torch.nn.Module:
    """The run's model: its preset's seeded initialisation or its folder's weights (identical
    in every process). ``meta``: on the meta device (shapes only), for tracing and cutting;
    a stage then makes only its own parameters real (``weight_source``)."""
    architecture = model_config(config)  # a folder's vocabulary must cover the data's
    if config.model == FOLDER:
        check_layers(Path(config.model_dir), architecture)
    if config.seq_len > architecture.block_size:
        raise ConfigError(
            f"seq_len {config.seq_len} exceeds the model's block_size {architecture.block_size}"
        )
    with torch.device("meta"):
        model = registry.build(architecture)
    if config.lora is not None:  # the base frozen, adapters on meta too
        add_adapters(model, config.lora)
    if not meta:
        materialise(model, weight_source(config))
    return model


def weight_source(config: TrainConfig) -> WeightSource:
    """Where the run's parameters come from: seeded per parameter name, or the folder; with
    adapters, their A seeded by name and their B zeros (lora.AdapterInit)."""
    if config.model == FOLDER:
        base: WeightSource = FolderWeights(config.model_dir, model_config(config))
    else:
        base = SeededInit(model_config(config), config.seed)
    return base if config.lora is None else AdapterInit(base, config.seed)


def build_layout(config: TrainConfig, model: torch.nn.Module) -> PipelineLayout:
    """Trace ``model`` at the micro-batch shape and cut it into the run's stages."""
    example = registry.example_input(config.batch_size, config.seq_len)  # (B, T)
    graph = trace_micro_batch(model, example)
    cuts = config.cuts if config.cuts is not None else balanced_cuts(graph, config.stages)
    return PipelineLayout(graph, cuts)


def trace_micro_batch(model: torch.nn.Module, example: torch.Tensor) -> OpGraph:
    """``model`` traced at one micro-batch, ``example`` (B, T) token ids.

    A small model: a real forward (the model is allocated anyway, and propagating meta tensors
    first imports torch's meta kernels, ~1.5 s per process here). A large one: meta tensors,
    as a real CPU forward of GPT-2 medium at 4 x 1024 tokens would take each process tens of
    seconds before it trains on its GPU. A model built on meta is traced on meta, whatever
    its size."""
    parameters = list(model.parameters())
    work = sum(p.numel() for p in parameters) * example.numel()
    on_meta = any(p.is_meta for p in parameters)
    return trace(model, (example,), meta=on_meta or work > _REAL_TRACE_MAX_WORK)


def load_dataset(config: TrainConfig) -> TokenDataset:
    return TokenDataset.load(
        config.data_path,
        dtype=config.data_dtype,
        vocab_size=config.vocab_size,
        stdlib_bytes=config.stdlib_bytes,
    )


def ratios_from_plan(plan: "Plan") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(activation_ratios, gradient_ratios) per link from an OP-Fence plan's AdaTopK choice
    (1.0 for a dense link, fp16 ones included: ``halves_from_plan`` says which)."""
    forward, backward = [], []
    for link in sorted(plan.links, key=lambda lp: lp.src_stage):
        forward.append(link.forward_ratio if link.forward_codec == "topk" else 1.0)
        backward.append(link.backward_ratio if link.backward_codec == "topk" else 1.0)
    return tuple(forward), tuple(backward)


def halves_from_plan(plan: "Plan") -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(activation_halves, gradient_halves) per link: the links the plan counts at 2 bytes an
    element (its "fp16" codec), which the runner then sends as such."""
    forward, backward = [], []
    for link in sorted(plan.links, key=lambda lp: lp.src_stage):
        forward.append(link.forward_codec == "fp16")
        backward.append(link.backward_codec == "fp16")
    return tuple(forward), tuple(backward)
