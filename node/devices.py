"""``--device auto|cpu|cuda|cuda:N`` -> a torch.device this process can use.

Imports nothing of the node: the device probe (control/) and the stage runtime (pipeline/)
both resolve the same flag the same way.
"""

import torch

from fusionllm.common.errors import ConfigError

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` names, checked to exist here (ConfigError otherwise)."""
    if not isinstance(spec, str):
        raise ConfigError(f"device must be one of {DEVICE_CHOICES}, got {spec!r}")
    text = spec.strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"device must be one of {DEVICE_CHOICES}, got {spec!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} asked for, but this torch sees no CUDA device")
    count = torch.cuda.device_count()
    number = int(index) if index else 0
    if number >= count:
        raise ConfigError(f"device {spec!r} asked for, but only {count} CUDA device(s) here")
    return torch.device("cuda", number)
