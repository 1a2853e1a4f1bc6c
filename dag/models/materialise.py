"""A model built on the meta device, made real one parameter at a time: a stage holds only its own.

A run's model is built on meta (shapes, no memory); a pipeline stage cut from it is then given
real tensors for just its parameters, from one of two sources:

- ``SeededInit``: a preset's random initialisation. Each parameter draws from its own generator,
  seeded from (run seed, canonical parameter name), so a parameter gets the same values whether
  a process builds the whole model or one stage of it, without drawing the other stages'
  values first (a single generator walked through the whole model would need them).
- ``FolderWeights``: a Hugging Face folder; every header is checked as ``from_pretrained``
  checks it, then only the stage's tensors are read (safetensors reads them by name).

``materialise`` swaps a module's meta parameters for real ones by identity, so a parameter tied
within the module (GPT-2's embedding and head in one stage) stays one tensor.
"""

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.models import registry
from fusionllm.dag.models.hf_errors import TensorShapeError
from fusionllm.dag.models.pretrained import read_parameters

logger = get_logger(__name__)


class WeightSource(Protocol):
    def tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """float32 CPU tensors for these canonical parameter names, of these shapes."""
        ...


class Unset:
    """Uninitialised memory: for parameters whose values are imported right after (a stage
    resumed from a checkpoint's state), so no init pass or weights file is read in vain."""

    def tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        return {name: torch.empty(shape) for name, shape in shapes.items()}


UNSET = Unset()


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed for one parameter: stable across processes, Pythons and platforms."""
    digest = hashlib.sha256(f"fusionllm-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SeededInit:
    """A preset's initialisation, one generator per parameter (the architecture's ``init_rule``
    says the distribution)."""

    def __init__(self, config: Any, seed: int) -> None:
        self.config = config
        self.seed = seed
        self._rule = registry.architecture_of(config).init_rule

    def tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name, shape) for name, shape in shapes.items()}

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        kind, std = self._rule(self.config, name)
        if kind == "zeros":
            return torch.zeros(shape)
        if kind == "ones":
            return torch.ones(shape)
        if kind != "normal":
            raise ConfigError(f"unknown init {kind!r} for {name}")
        generator = torch.Generator(device="cpu").manual_seed(parameter_seed(self.seed, name))
        return torch.empty(shape).normal_(0.0, std, generator=generator)


class FolderWeights:
    """The tensors of a Hugging Face folder whose config is ``config``."""

    def __init__(self, folder: str | Path, config: Any) -> None:
        self.folder = Path(folder)
        self.config = config

    def tensors(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            meta_model = registry.build(self.config)  # what every header is checked against
        tensors = read_parameters(self.folder, self.config, meta_model, only=set(shapes))
        wrong = [n for n, s in shapes.items() if n not in tensors or tuple(tensors[n].shape) != s]
        if wrong:  # the module asked for what the folder's config does not make
            raise TensorShapeError(f"{self.folder} does not hold {wrong[:5]} as the stage needs")
        return {name: tensors[name] for name in shapes}


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Every parameter name of ``module`` -> the first name its tensor has (tied ones share)."""
    first: dict[int, str] = {}
    return {
        name: first.setdefault(id(p), name)
        for name, p in module.named_parameters(remove_duplicate=False)
    }


def materialise(
    module: nn.Module, source: WeightSource, canonical: Mapping[str, str] | None = None
) -> list[str]:
    """Give ``module``'s meta parameters real values from ``source``, in place; returns the
    canonical names made real. ``canonical`` maps the module's names to the model's canonical
    ones (a stage module's come from its OpGraph); default: the module is the whole model."""
    canonical = canonical_names(module) if canonical is None else canonical
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    wanted: dict[int, tuple[str, nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.is_meta:
            continue
        owner_name, _, attr = name.rpartition(".")
        owners.setdefault(id(param), []).append((module.get_submodule(owner_name), attr))
        wanted.setdefault(id(param), (canonical[name], param))
    values = source.tensors({c: tuple(p.shape) for c, p in wanted.values()})
    for key, (name, param) in wanted.items():
        real = nn.Parameter(values[name], requires_grad=param.requires_grad)
        for owner, attr in owners[key]:
            setattr(owner, attr, real)
    logger.debug("materialised %d parameters", len(wanted))
    return [name for name, _ in wanted.values()]
