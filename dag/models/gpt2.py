"""GPT-2 written for torch.fx: same parameter names and layouts as Hugging Face's GPT2LMHeadModel.

forward(idx) -> logits; the loss is left to whoever holds the last pipeline stage. Tracing needs
no data-dependent control flow: attention is ``scaled_dot_product_attention(is_causal=True)``
and position ids come from a wrapped helper, so each is one node of the OP-DAG.

Checkpoints: ``from_hf_name`` maps a GPT2LMHeadModel's or GPT2Model's tensor names to ours
(with or without the ``transformer.`` prefix; the old ``attn.bias`` / ``attn.masked_bias`` mask
buffers, which we do not need, are dropped); ``pretrained.py`` reads and writes the folders.
"""

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.flops import function_cost, leaf_module, linear_cost, zero_cost

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """Sizes of one GPT-2; the named presets are in ``PRESETS``."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    block_size: int = 1024
    layer_norm_epsilon: float = 1e-5
    # HF trains GPT-2 with 0.1; 0 keeps a step deterministic and is what pretraining at scale uses.
    dropout: float = 0.0
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPT2Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.layer_norm_epsilon <= 0:
            raise ConfigError(f"layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def num_hidden_layers(self) -> int:
        """n_layer under the name every registered config has (HF's GPT2Config aliases it too)."""
        return self.n_layer


PRESETS: dict[str, GPT2Config] = {
    # Byte-level: vocabulary 256, so it trains on raw text with no tokenizer.
    "tiny": GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64),
    "small": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
}


@leaf_module(linear_cost)
class Conv1D(nn.Module):
    """HF's Conv1D: a linear layer storing its weight (in, out), so HF checkpoints load as-is."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x @ W + b with W (in, out); addmm on the flattened rows is what HF runs.
        flat = torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight)
        return flat.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


@function_cost(zero_cost)
@torch.fx.wrap
def position_ids(idx: torch.Tensor) -> torch.Tensor:
    """0..T-1 for idx (B, T); wrapped so fx records one node instead of tracing through arange."""
    return torch.arange(idx.shape[-1], device=idx.device)  # (T,)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3C)
        # Slices rather than split(): every value in the graph stays a single tensor, so any
        # cut sends tensors, never a tuple.
        c = self.n_embd
        q, k, v = qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :]  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs); unflatten needs no sizes, so fx sees no size() calls.
        q = q.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        k = k.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        y = functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).flatten(-2)  # (B, T, C)
        y = self.c_proj(y)
        if self.resid_dropout is not None:
            y = self.resid_dropout(y)
        return y


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = functional.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C); HF's "gelu_new"
        h = self.c_proj(h)  # (B, T, C)
        if self.dropout is not None:
            h = self.dropout(h)
        return h


class Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))
        return x


class Transformer(nn.Module):
    """HF's GPT2Model minus the mask buffers: embeddings, blocks, final layer norm."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0 else None
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(position_ids(idx))  # (B, T, C)
        if self.drop is not None:
            x = self.drop(x)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2(nn.Module):
    """GPT-2 language model: idx (B, T) int64 -> logits (B, T, vocab_size).

    ``lm_head.weight`` is ``transformer.wte.weight`` (tied, as in HF) unless the config unties
    them; a pipeline that puts them in different stages must keep the two copies equal by
    summing their gradients.
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_weights()
        self.tie_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        # GPT-2 scales the projections into the residual stream by 1/sqrt(2 * n_layer).
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, std=std)
            nn.init.normal_(block.mlp.c_proj.weight, std=std)
        if not self.config.tie_word_embeddings:
            # Last, so a tied model draws what it always drew from a seed.
            nn.init.normal_(self.lm_head.weight, std=0.02)

    def tie_weights(self) -> None:
        """Make the head the embedding again (loading with ``assign=True`` unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))  # (B, T, vocab_size)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied embedding counted once), as HF reports them."""
        return sum(p.numel() for p in self.parameters())


def init_rule(config: GPT2Config, name: str) -> tuple[str, float]:
    """How a seeded run initialises parameter ``name``: ("normal", std), ("zeros", 0) or
    ("ones", 0); what ``_init_weights`` does, per parameter (``dag/models/seeded.py``)."""
    if name.endswith(".bias"):
        return ("zeros", 0.0)
    if ".ln_" in name or name.startswith("transformer.ln_"):
        return ("ones", 0.0)
    if name.endswith("c_proj.weight"):
        return ("normal", 0.02 / math.sqrt(2 * config.n_layer))
    if name.endswith(".weight"):  # embeddings, c_attn, c_fc, an untied head
        return ("normal", 0.02)
    raise ConfigError(f"GPT-2 has no parameter named {name!r}")


def gpt2(
    name: str = "small",
    *,
    vocab_size: int | None = None,
    block_size: int | None = None,
    dropout: float | None = None,
) -> GPT2:
    """A randomly initialised GPT-2 of a named size: tiny, small, medium, large or xl.

    Build it under ``with torch.device("meta"):`` to trace a big one without allocating it.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown GPT-2 size {name!r}; choose one of {sorted(PRESETS)}")
    overrides = {
        key: value
        for key, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("dropout", dropout),
        )
        if value is not None
    }
    return GPT2(replace(PRESETS[name], **overrides))


_DROPPED_BUFFERS = (".attn.bias", ".attn.masked_bias")


def from_hf_name(name: str) -> str | None:
    """Our name for a tensor of a Hugging Face GPT-2 file; None for the old mask buffers.

    GPT2LMHeadModel files say ``transformer.h.0...``; GPT2Model files (the hub's ``gpt2``
    among them) have no prefix.
    """
    if name.endswith(_DROPPED_BUFFERS):
        return None
    if name.startswith(("transformer.", "lm_head.")):
        return name
    return f"transformer.{name}"
