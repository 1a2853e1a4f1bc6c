"""Llama-family decoders written for torch.fx, with Hugging Face LlamaForCausalLM's names.

forward(idx) -> logits, like the zoo's GPT-2: RMSNorm, rotary position embeddings, SwiGLU MLP,
grouped-query attention, tied or untied embeddings. Each attention layer rotates its own
queries and keys from the sequence length (``Rotary`` is one OP-DAG node per use), so no
position table is a value that crosses a pipeline cut: between stages only the residual
stream travels.
"""

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.flops import elementwise, leaf_module
from fusionllm.dag.models.rope import RopeConfig, inverse_frequencies

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Sizes of one Llama; the field names are Hugging Face's LlamaConfig's."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be even and >= 2, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    @property
    def block_size(self) -> int:
        """The longest sequence the model was configured for (GPT2Config's name for it)."""
        return self.max_position_embeddings


PRESETS: dict[str, LlamaConfig] = {
    # Byte-level like GPT-2 tiny; GQA (2 queries per key) and untied, so tests cover both.
    "llama-tiny": LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=172,
        vocab_size=256,
        max_position_embeddings=256,
    ),
    # Llama 3.2 1B's shapes (1,235,814,400 parameters), for planning.
    "llama-1b": LlamaConfig(
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=2048,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=500000.0, kind="llama3", factor=32.0),
        tie_word_embeddings=True,
    ),
}


@leaf_module(elementwise(4, 8, saves="input"))
class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: normalised in fp32 whatever the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., C)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@leaf_module(elementwise(4, 4, saves="none"))
class Rotary(nn.Module):
    """Rotates x (B, heads, T, head_dim) by position 0..T-1 (rotate_half, as Hugging Face)."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Not saved with the weights (it follows from the config), and real even when the
        # model is built on the meta device, so a loaded model needs no extra step.
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.at(x, 0)

    def at(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x rotated by positions start..start+T-1 (decoding with a KV cache starts past 0)."""
        positions = torch.arange(start, start + x.shape[-2], device=x.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(x.device, torch.float32)  # (T, hd/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, nh, T, hd)
        return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head = config.num_attention_heads
        self.n_kv_head = config.num_key_value_heads
        self.head_dim = config.head_dim
        c, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(c, self.n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c, self.n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c, self.n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, c, bias=bias)
        self.rotary = Rotary(config.head_dim, config.rope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, heads * hd) -> (B, heads, T, hd); unflatten needs no sizes from the trace.
        q = self.q_proj(x).unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim)).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        # Query head i reads key/value head i // (n_head / n_kv_head), as repeat_kv does.
        y = functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head
        )  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).flatten(-2))  # (B, T, C)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(c, hidden, bias=bias)
        self.up_proj = nn.Linear(c, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, c, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = functional.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, I)
        return self.down_proj(h)  # (B, T, C)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Hugging Face's LlamaModel: embeddings, decoder layers, final norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Llama(nn.Module):
    """Llama language model: idx (B, T) int64 -> logits (B, T, vocab_size).

    With ``tie_word_embeddings`` the head is the embedding (one parameter, two names), kept
    equal across pipeline stages as GPT-2's is.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()
        self.tie_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def tie_weights(self) -> None:
        """Make the head the embedding again (loading with ``assign=True`` unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))  # (B, T, vocab_size)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied embedding counted once), as Hugging Face reports them."""
        return sum(p.numel() for p in self.parameters())


def init_rule(config: LlamaConfig, name: str) -> tuple[str, float]:
    """How a seeded run initialises parameter ``name``: ("normal", std), ("zeros", 0) or
    ("ones", 0); what ``_init_weights`` does, per parameter (``dag/models/seeded.py``)."""
    if name.endswith(".bias"):
        return ("zeros", 0.0)
    if name.endswith("norm.weight"):  # RMSNorm: input_layernorm, post_attention_layernorm, norm
        return ("ones", 0.0)
    if name.endswith(".weight"):  # embeddings, projections, an untied head
        return ("normal", 0.02)
    raise ConfigError(f"Llama has no parameter named {name!r}")


def llama(
    name: str = "llama-tiny",
    *,
    vocab_size: int | None = None,
    max_position_embeddings: int | None = None,
) -> Llama:
    """A randomly initialised Llama of a named preset (``PRESETS``).

    Build it under ``with torch.device("meta"):`` to trace a big one without allocating it.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}")
    overrides = {
        key: value
        for key, value in (
            ("vocab_size", vocab_size),
            ("max_position_embeddings", max_position_embeddings),
        )
        if value is not None
    }
    return Llama(replace(PRESETS[name], **overrides))


def from_hf_name(name: str) -> str | None:
    """Our name for a tensor of a Hugging Face Llama file; None for old rotary buffers.

    LlamaForCausalLM files say ``model.layers.0...``; LlamaModel files have no prefix.
    """
    if name.endswith("rotary_emb.inv_freq"):  # saved by transformers < 4.31; follows from config
        return None
    if name.startswith(("model.", "lm_head.")):
        return name
    return f"model.{name}"
