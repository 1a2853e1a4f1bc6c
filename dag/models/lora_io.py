"""Adapters in PEFT's layout, in and out, and the merged model; no peft import.

A folder is ``adapter_config.json`` (PEFT's LoraConfig fields: ``r``, ``lora_alpha``,
``target_modules``, ``fan_in_fan_out`` for GPT-2's Conv1D, ...) plus
``adapter_model.safetensors`` whose keys are PEFT's for the transformers model:
``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r), where
``<module>`` is the layer's name in GPT2LMHeadModel / LlamaForCausalLM (= ours). So
``PeftModel.from_pretrained(transformers_model, folder)`` loads what a swarm fine-tuned, and
``merged`` gives what PEFT's ``merge_and_unload`` gives.

A folder read back is untrusted: its JSON is bounded and typed, every key must name an adapter
of the model the config makes, every tensor must have that adapter's shape and be finite.
"""

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusionllm.common.atomic import write_atomic
from fusionllm.common.logs import get_logger
from fusionllm.dag.models.gpt2 import GPT2
from fusionllm.dag.models.hf_errors import CheckpointFolderError, MissingFileError, TensorShapeError
from fusionllm.dag.models.hf_tensors import CONFIG, MAX_CONFIG_BYTES, read_json, write_tensors
from fusionllm.dag.models.lora import LoraConfig, add_adapters, is_adapter, merge_adapters
from fusionllm.dag.models.lora import targets_of as _targets_of
from fusionllm.dag.models.pretrained import from_pretrained, save_state

logger = get_logger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
MAX_ADAPTER_BYTES = 4 << 30


def peft_key(name: str) -> str:
    """Our adapter parameter name -> PEFT's saved key (``X.lora_A`` -> ``...X.lora_A.weight``)."""
    if not is_adapter(name):
        raise ValueError(f"{name} is not an adapter parameter")
    return f"{_PREFIX}{name}.weight"


def our_name(key: str) -> str | None:
    """PEFT's saved key -> our adapter parameter name; None for a key that is not one."""
    if not key.startswith(_PREFIX) or not key.endswith(".weight"):
        return None
    name = key[len(_PREFIX) : -len(".weight")]
    return name if is_adapter(name) else None


def peft_config(model: nn.Module, lora: LoraConfig, *, base: str | None) -> dict[str, Any]:
    """adapter_config.json for ``lora`` on ``model`` (the base, not yet adapted, or adapted)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": alpha,
        "target_modules": sorted(_targets_of(model, lora)),
        "fan_in_fan_out": isinstance(model, GPT2),  # Conv1D stores its weight (in, out)
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_adapters(
    model: nn.Module,
    lora: LoraConfig,
    adapters: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    base: str | None = None,
) -> Path:
    """Write ``adapters`` (our names -> tensors; every A and B of ``model`` with ``lora``) as a
    PEFT folder; ``base``: the base model's folder, for adapter_config.json."""
    folder = Path(path)
    expected = adapter_shapes(model, lora)
    got = {n: tuple(t.shape) for n, t in adapters.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(n for n in got if got[n] != expected[n])
        raise TensorShapeError(f"adapters do not fit the model: {wrong[:5]}")
    for name, tensor in adapters.items():
        if not torch.isfinite(tensor).all():
            raise CheckpointFolderError(f"{name} holds NaN or infinity; refusing to save it")
    tensors = {peft_key(n): t.to(torch.float32) for n, t in adapters.items()}
    write_tensors(folder, tensors, name=ADAPTER_WEIGHTS)
    text = json.dumps(peft_config(model, lora, base=base), indent=2, sort_keys=True) + "\n"
    write_atomic(folder / ADAPTER_CONFIG, text.encode())
    logger.info("wrote %d adapter tensors (rank %d) to %s", len(tensors), lora.rank, folder)
    return folder


def adapter_shapes(model: nn.Module, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """Every adapter parameter ``lora`` gives ``model`` (plain, on meta: nothing allocated)."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    add_adapters(twin, lora)
    return {n: tuple(p.shape) for n, p in twin.named_parameters() if is_adapter(n)}


def read_lora_config(path: str | os.PathLike[str]) -> tuple[LoraConfig, str | None]:
    """The LoraConfig of a PEFT folder's adapter_config.json, and the base it names."""
    fields = read_json(Path(path) / ADAPTER_CONFIG, limit=MAX_CONFIG_BYTES)
    if fields.get("peft_type") != "LORA":
        raise CheckpointFolderError(f"{path}: peft_type {fields.get('peft_type')!r}, not LORA")
    for key, allowed in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if fields.get(key, allowed) != allowed:
            raise CheckpointFolderError(f"{path}: {key}={fields[key]!r} is not supported")
    rank, alpha, targets = fields.get("r"), fields.get("lora_alpha"), fields.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list):
        raise CheckpointFolderError(f"{path}: target_modules must be a list of module names")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise CheckpointFolderError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    if not alpha > 0:
        raise CheckpointFolderError(f"{path}: lora_alpha must be > 0, got {alpha}")
    base = fields.get("base_model_name_or_path")
    return LoraConfig(rank=rank, alpha=float(alpha), targets=tuple(targets)), (
        base if isinstance(base, str) else None
    )


def load_adapters(model: nn.Module, path: str | os.PathLike[str]) -> LoraConfig:
    """Adapt ``model`` (plain, real) with a PEFT folder's adapters, in place; returns their
    config. Refuses keys that are not the model's adapters, shapes, dtypes and non-finite
    values before touching the model."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    lora, _ = read_lora_config(folder)
    expected = adapter_shapes(model, lora)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise MissingFileError(f"{folder} has no {ADAPTER_WEIGHTS}")
    if weights.stat().st_size > MAX_ADAPTER_BYTES:
        raise CheckpointFolderError(f"{weights} is over {MAX_ADAPTER_BYTES} bytes")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as file:
            keys = set(file.keys())
            names = {key: our_name(key) for key in keys}
            unknown = sorted(k for k, n in names.items() if n is None or n not in expected)
            missing = sorted(set(expected) - set(names.values()))
            if unknown or missing:
                raise TensorShapeError(
                    f"{weights}: unexpected {unknown[:5]}, missing {missing[:5]} for rank "
                    f"{lora.rank} on {list(lora.targets)}"
                )
            for key, name in names.items():
                part = file.get_slice(key)
                if part.get_dtype() not in ("F32", "F16", "BF16", "F64"):
                    raise CheckpointFolderError(f"{key} is {part.get_dtype()}, not a float")
                if tuple(part.get_shape()) != expected[name]:
                    raise TensorShapeError(
                        f"{key} is {part.get_shape()}, the model's is {list(expected[name])}"
                    )
                tensors[name] = file.get_tensor(key).to(torch.float32)
    except SafetensorError as exc:
        raise CheckpointFolderError(f"{weights} is not a readable safetensors file: {exc}") from exc
    bad = sorted(n for n, t in tensors.items() if not torch.isfinite(t).all())
    if bad:
        raise CheckpointFolderError(f"{weights}: {bad[:5]} hold NaN or infinity")
    add_adapters(model, lora)
    with torch.no_grad():
        for name, tensor in tensors.items():
            model.get_parameter(name).copy_(tensor)
    return lora


def merged(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """``model`` (plain, real) with a PEFT folder's adapters folded into its weights, in place:
    what PEFT's ``merge_and_unload`` gives."""
    load_adapters(model, path)
    return merge_adapters(model)


def export_merged(
    model_dir: str | os.PathLike[str],
    adapter_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
) -> Path:
    """A Hugging Face folder of ``model_dir``'s model with ``adapter_dir``'s adapters merged
    into its weights (its config.json's other keys kept), which transformers loads as the
    architecture it was."""
    model = merged(from_pretrained(model_dir), adapter_dir)
    like = read_json(Path(model_dir) / CONFIG, limit=MAX_CONFIG_BYTES)
    return save_state(model.config, model.state_dict(), out, like=like)
