"""config.json <-> our model configs, for GPT-2 and Llama, as transformers 4.x and 5.x write it.

``config_from_hf`` reads the fields that change what the model computes and refuses, with
``UnsupportedModelError``, any value we would otherwise silently compute differently (another
activation, a rope type we do not implement, a per-layer scaling). ``hf_config_of`` writes the
fields back in a form both 4.x and 5.x read: rope settings as 4.x's ``rope_theta`` and
``rope_scaling`` (5.x converts them) and as 5.x's ``rope_parameters``.
"""

import math
from collections.abc import Mapping
from typing import Any

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.models.gpt2 import GPT2Config
from fusionllm.dag.models.hf_errors import UnsupportedModelError
from fusionllm.dag.models.llama import LlamaConfig
from fusionllm.dag.models.rope import RopeConfig

logger = get_logger(__name__)

ModelConfig = GPT2Config | LlamaConfig

# model_type and the class name transformers saves under "architectures", per family.
FAMILIES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
_MAX_SIZE = 1 << 31  # no dimension of a real model comes near; bigger is a hostile file
_MAX_HEAD_DIM = 1 << 14  # the rotary table (head_dim / 2 floats) is allocated before any check
_MISSING = object()
# Keys of a source config.json that describe its file, not the model: never carried over.
_NOT_KEPT = ("dtype", "torch_dtype", "transformers_version", "_name_or_path")


def family_of(raw: Mapping[str, Any]) -> str:
    """The family, "gpt2" or "llama": model_type, or without one the architectures list."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures")
    if isinstance(model_type, str) and model_type in FAMILIES:
        return model_type
    if model_type is None and isinstance(architectures, list):
        for family, class_name in FAMILIES.items():
            if class_name in architectures:
                return family
    raise UnsupportedModelError(
        f"config.json describes model_type {model_type!r} (architectures {architectures!r}); "
        f"supported: {', '.join(f'{f} ({c})' for f, c in FAMILIES.items())}"
    )


def config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Our config for a parsed config.json (a JSON object)."""
    family = family_of(raw)
    try:
        return _gpt2(raw) if family == "gpt2" else _llama(raw)
    except UnsupportedModelError:
        raise
    except ConfigError as exc:  # our config's own checks: the file's numbers are inconsistent
        raise UnsupportedModelError(f"config.json ({family}): {exc}") from exc


def _gpt2(raw: Mapping[str, Any]) -> GPT2Config:
    n_embd = _int(raw, "n_embd")
    activation = raw.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse("activation_function", activation, "gelu_new")
    n_inner = raw.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embd:
        _refuse("n_inner", n_inner, f"null or 4 * n_embd = {4 * n_embd}")
    for key, supported in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if raw.get(key, supported) is not supported:
            _refuse(key, raw.get(key), supported)
    return GPT2Config(
        n_layer=_int(raw, "n_layer"),
        n_head=_int(raw, "n_head"),
        n_embd=n_embd,
        vocab_size=_int(raw, "vocab_size"),
        block_size=_int(raw, "n_positions"),
        layer_norm_epsilon=_float(raw, "layer_norm_epsilon", 1e-5),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", True),
    )


def _llama(raw: Mapping[str, Any]) -> LlamaConfig:
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        _refuse("hidden_act", raw.get("hidden_act"), "silu")
    if raw.get("attention_dropout", 0.0) not in (0, 0.0, None):
        logger.warning("config.json sets attention_dropout; fusionllm trains without dropout")
    heads = _int(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads")
    head_dim = raw.get("head_dim")
    config = LlamaConfig(
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else _int(raw, "num_key_value_heads"),
        hidden_size=_int(raw, "hidden_size"),
        intermediate_size=_int(raw, "intermediate_size"),
        vocab_size=_int(raw, "vocab_size"),
        max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
        head_dim=0 if head_dim is None else _int(raw, "head_dim"),
        rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
        rope=rope_from_hf(raw),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        attention_bias=_bool(raw, "attention_bias", False),
        mlp_bias=_bool(raw, "mlp_bias", False),
    )
    if config.head_dim > _MAX_HEAD_DIM:  # given, or hidden_size / num_attention_heads
        _refuse("head_dim", config.head_dim, f"at most {_MAX_HEAD_DIM}")
    return config


def rope_from_hf(raw: Mapping[str, Any]) -> RopeConfig:
    """5.x's ``rope_parameters``, else 4.x's ``rope_scaling`` with the top-level ``rope_theta``."""
    params = raw.get("rope_parameters")
    if params is None:
        params = raw.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        _refuse("rope_parameters", params, "one flat object (per-layer-type rope is not supported)")
    merged = dict(params)
    merged.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", merged["partial_rotary_factor"], 1.0)
    if merged.get("attention_factor", 1.0) not in (1, 1.0, None):
        _refuse("rope attention_factor", merged["attention_factor"], 1.0)
    try:
        return RopeConfig(
            theta=_float(merged, "rope_theta"),
            kind=kind,
            factor=_float(merged, "factor", 1.0),
            low_freq_factor=_float(merged, "low_freq_factor", 1.0),
            high_freq_factor=_float(merged, "high_freq_factor", 4.0),
            original_max_position_embeddings=_int(merged, "original_max_position_embeddings", 8192),
        )
    except ConfigError as exc:
        raise UnsupportedModelError(f"config.json rope settings {merged}: {exc}") from exc


def hf_config_of(config: ModelConfig, *, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json for a model of this config (with ``dtype`` float32: what we save).

    ``like``: the config.json the model was loaded from; its other keys (token ids, names a
    tokenizer needs) are kept, except those about the stored dtype and the writer.
    """
    ours = _fields_of(config)
    if like is None:
        return ours
    return {k: v for k, v in like.items() if k not in _NOT_KEPT} | ours


def _fields_of(config: ModelConfig) -> dict[str, Any]:
    if isinstance(config, GPT2Config):
        return {
            "architectures": [FAMILIES["gpt2"]],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.block_size,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": config.layer_norm_epsilon,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "tie_word_embeddings": config.tie_word_embeddings,
            "dtype": "float32",
        }
    rope = config.rope
    params: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.kind != "default":
        params["factor"] = rope.factor
    if rope.kind == "llama3":
        params |= {
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    scaling = (
        None if rope.kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    )
    return {
        "architectures": [FAMILIES["llama"]],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "rope_parameters": params,
        "dtype": "float32",
    }


def _refuse(key: str, value: object, supported: object) -> None:
    raise UnsupportedModelError(f"config.json {key} = {value!r} is not supported (use {supported})")


def _int(raw: Mapping[str, Any], key: str, default: object = _MISSING) -> int:
    value = raw.get(key, default)
    if value is _MISSING:
        raise UnsupportedModelError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < _MAX_SIZE:
        raise UnsupportedModelError(
            f"config.json {key} must be an integer in [1, 2**31), got {value!r}"
        )
    return value


def _float(raw: Mapping[str, Any], key: str, default: object = _MISSING) -> float:
    value = raw.get(key, default)
    if value is _MISSING:
        raise UnsupportedModelError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UnsupportedModelError(f"config.json {key} must be a finite number, got {value!r}")
    return float(value)


def _bool(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise UnsupportedModelError(f"config.json {key} must be true or false, got {value!r}")
    return value
