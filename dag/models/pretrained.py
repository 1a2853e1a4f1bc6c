"""Hugging Face folders in and out: ``from_pretrained`` and ``save_pretrained``, no transformers.

A folder is ``config.json`` plus ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``). Reading builds the model on the meta device, checks every
tensor's name, shape and dtype in the headers against it, then assigns the loaded (float32)
tensors: nothing is allocated twice and a folder that does not match its config is refused
before its values are read. Writing gives what transformers' ``save_pretrained`` gives for a
float32 GPT2LMHeadModel or LlamaForCausalLM (a tied head is not stored), so its
``from_pretrained`` finds no missing or unexpected keys.
"""

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusionllm.common.atomic import write_atomic
from fusionllm.common.logs import get_logger
from fusionllm.dag.models import registry
from fusionllm.dag.models.hf_config import ModelConfig, config_from_hf, hf_config_of
from fusionllm.dag.models.hf_errors import MissingFileError, TensorShapeError, TensorValueError
from fusionllm.dag.models.hf_tensors import (
    CONFIG,
    MAX_CONFIG_BYTES,
    read_json,
    read_tensors,
    tensor_count,
    write_tensors,
)

logger = get_logger(__name__)

_HEAD = "lm_head.weight"


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model config a folder's config.json describes (no weights are read)."""
    folder = Path(path)
    if not folder.is_dir():
        raise MissingFileError(f"{folder} is not a directory")
    return config_from_hf(read_json(folder / CONFIG, limit=MAX_CONFIG_BYTES))


def from_pretrained(path: str | os.PathLike[str]) -> nn.Module:
    """The folder's model in float32 on the CPU: ``model(idx)`` -> logits (B, T, vocab)."""
    folder = Path(path)
    config = read_config(folder)
    check_layers(folder, config)
    with torch.device("meta"):
        model = registry.build(config)
    tensors = read_parameters(folder, config, model)
    arch = registry.architecture_of(config)
    if config.tie_word_embeddings:
        tensors[_HEAD] = tensors[arch.embedding]
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()  # assign=True gave the head its own Parameter
    logger.info("loaded %s (%s) from %s", type(model).__name__, arch.family, folder)
    return model


def check_layers(folder: Path, config: ModelConfig) -> None:
    """Refuse a config.json asking for more layers than the folder has tensors: call it before
    building the model, as a module per layer costs time even on meta."""
    layers = config.num_hidden_layers
    tensors_in_folder = tensor_count(folder)
    if layers > tensors_in_folder:
        raise TensorShapeError(
            f"config.json asks for {layers} layers; the folder holds {tensors_in_folder} tensors"
        )


def read_parameters(
    folder: Path, config: ModelConfig, meta_model: nn.Module, only: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """The folder's tensors for ``meta_model`` (``config``'s, built on meta) as float32, by
    our names (a tied head under the embedding's name only); with ``only``, just those, so a
    pipeline stage reads its own slice of the file. Every header is checked either way."""
    arch = registry.architecture_of(config)
    expected = {name: tuple(t.shape) for name, t in meta_model.state_dict().items()}
    optional: frozenset[str] = frozenset()
    wanted = None if only is None else set(only)
    if config.tie_word_embeddings:
        del expected[_HEAD]
        optional = frozenset({_HEAD})  # some writers store the tied head anyway
        if wanted is not None and arch.embedding in wanted:
            wanted.add(_HEAD)  # to check it against the embedding, as a whole load does
    tensors = read_tensors(
        folder, expected=expected, optional=optional, rename=arch.from_hf_name, only=wanted
    )
    if config.tie_word_embeddings:
        head = tensors.pop(_HEAD, None)
        if head is not None and not torch.equal(head, tensors[arch.embedding]):
            raise TensorValueError(
                f"{folder}: config.json ties {_HEAD} to {arch.embedding} but the file's differ"
            )
    return tensors


def save_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` (a registered architecture) as a Hugging Face folder."""
    return save_state(model.config, model.state_dict(), path)


def save_state(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    like: Mapping[str, Any] | None = None,
) -> Path:
    """Write parameters under our names (= Hugging Face's) as a folder for ``config``
    (``like``: the config.json it came from, whose other keys are kept; ``hf_config_of``).

    Refuses a state that does not fit the config (missing, unexpected or misshapen tensors)
    or holds non-finite values: an export should fail loudly, not write what cannot load.
    """
    folder = Path(path)
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in registry.build(config).state_dict().items()}
    tensors = {name: t.to(torch.float32) for name, t in state.items()}
    if config.tie_word_embeddings:
        expected.pop(_HEAD)
        tensors.pop(_HEAD, None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshapen = sorted(
        n for n in expected.keys() & tensors if expected[n] != tuple(tensors[n].shape)
    )
    if missing or unexpected or misshapen:
        raise TensorShapeError(
            f"state does not fit the config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, misshapen {misshapen[:5]}"
        )
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            raise TensorValueError(f"{name} holds NaN or infinity; refusing to export it")
    write_tensors(folder, tensors)
    text = json.dumps(hf_config_of(config, like=like), indent=2, sort_keys=True) + "\n"
    write_atomic(folder / CONFIG, text.encode())
    logger.info("wrote %d tensors and %s to %s", len(tensors), CONFIG, folder)
    return folder
