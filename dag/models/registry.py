"""The model registry: every architecture a run can train, and the one way to build each.

Everything that builds a model goes through here (the stage runtime, the swarm's trainer, the
facts child that costs a model for the planner, ``from_pretrained``), so a new architecture
plugs in at one place: write its module (a kw-only config with ``vocab_size``,
``block_size``, ``num_hidden_layers`` and ``tie_word_embeddings``; an nn.Module
``forward(idx (B, T) int64) -> logits (B, T, V)`` that traces with torch.fx; named presets;
``from_hf_name``; ``init_rule``, how a seeded run initialises each parameter), add an
``Architecture`` to ``ARCHITECTURES``, and its config.json fields to ``hf_config.py``.
Preset names are global: ``common.run_spec.MODELS`` lists the same names (a unit test keeps
them equal).
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from fusionllm.common.errors import ConfigError
from fusionllm.dag.models.gpt2 import GPT2, GPT2Config
from fusionllm.dag.models.gpt2 import PRESETS as GPT2_PRESETS
from fusionllm.dag.models.gpt2 import from_hf_name as gpt2_name
from fusionllm.dag.models.gpt2 import init_rule as gpt2_init
from fusionllm.dag.models.llama import PRESETS as LLAMA_PRESETS
from fusionllm.dag.models.llama import Llama, LlamaConfig
from fusionllm.dag.models.llama import from_hf_name as llama_name
from fusionllm.dag.models.llama import init_rule as llama_init


@dataclass(frozen=True, kw_only=True)
class Architecture:
    family: str  # Hugging Face's model_type
    config_type: type
    model_type: type[nn.Module]
    presets: Mapping[str, Any]
    embedding: str  # the input embedding's parameter name (the tied head is the same tensor)
    from_hf_name: Callable[[str], str | None]
    # (config, parameter name) -> ("normal", std) | ("zeros", 0) | ("ones", 0): seeded.py
    init_rule: Callable[[Any, str], tuple[str, float]]


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        family="gpt2",
        config_type=GPT2Config,
        model_type=GPT2,
        presets=GPT2_PRESETS,
        embedding="transformer.wte.weight",
        from_hf_name=gpt2_name,
        init_rule=gpt2_init,
    ),
    Architecture(
        family="llama",
        config_type=LlamaConfig,
        model_type=Llama,
        presets=LLAMA_PRESETS,
        embedding="model.embed_tokens.weight",
        from_hf_name=llama_name,
        init_rule=llama_init,
    ),
)


def preset_names() -> tuple[str, ...]:
    return tuple(name for arch in ARCHITECTURES for name in arch.presets)


def architecture_of(config: object) -> Architecture:
    for arch in ARCHITECTURES:
        if isinstance(config, arch.config_type):
            return arch
    raise ConfigError(f"no architecture is registered for {type(config).__name__}")


def preset_config(name: str, *, vocab_size: int | None = None) -> Any:
    """A preset's config, with the run's vocabulary when given (the data decides it)."""
    for arch in ARCHITECTURES:
        if name in arch.presets:
            config = arch.presets[name]
            return config if vocab_size is None else replace(config, vocab_size=vocab_size)
    raise ConfigError(f"unknown model {name!r}; choose one of {list(preset_names())}")


def build(config: object) -> nn.Module:
    """A randomly initialised model of ``config`` (under ``torch.device("meta")``: no memory)."""
    return architecture_of(config).model_type(config)


def build_preset(name: str, *, vocab_size: int | None = None) -> nn.Module:
    return build(preset_config(name, vocab_size=vocab_size))


def example_input(batch_size: int, seq_len: int) -> torch.Tensor:
    """What every registered model takes: token ids (B, T) int64 (zeros: only shapes matter)."""
    return torch.zeros(batch_size, seq_len, dtype=torch.int64)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy: logits (B, T, V) against targets (B, T)."""
    return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
