"""Where a stage computes and in what precision: ``--device`` and ``--precision``.

- ``resolve_device`` (node/devices.py, which the device probe shares): ``auto|cpu|cuda|cuda:N``
  -> a ``torch.device`` this process can use, or a ConfigError that says why not.
- ``Compute``: a device and a precision. Parameters and optimizer state stay float32 (the
  master weights) whatever the precision; ``autocast`` runs the forward (and so the backward)
  in bf16/fp16 where torch's autocast lists say it is safe. fp16's loss scaling is the
  runner's (a step is skipped by every stage together), not torch's per-process GradScaler.
- ``Staging``: device <-> host copies through pinned buffers reused per key (a link and
  direction), so a frame is packed from and unpacked onto the device without a pinned
  allocation per frame, and a host-to-device copy does not block the host.

The device is a node's own choice (it never enters the run's settings); the precision is the
run's (``RunSpec.precision``): every stage of a run computes alike.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import PRECISIONS
from fusionllm.node.devices import DEVICE_CHOICES, resolve_device

__all__ = ["DEVICE_CHOICES", "Compute", "Staging", "pins_frames", "resolve_device"]

logger = get_logger(__name__)

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Compute:
    """A stage's device and precision."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise ConfigError(f"device must be a torch.device, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    @classmethod
    def of(cls, device: str = "cpu", precision: str = "fp32") -> "Compute":
        return cls(device=resolve_device(device), precision=precision)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPES.get(self.precision)

    @property
    def fused_optimizer(self) -> bool:
        """Whether torch's fused AdamW kernel exists for this device (CPU and CUDA here)."""
        return self.device.type in ("cpu", "cuda")

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward's precision; float32 runs plain (no autocast at all)."""
        dtype = self.autocast_dtype
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=dtype):
            yield

    def peak_memory_bytes(self) -> int:
        """The most device memory torch held for tensors so far (0 on the CPU)."""
        return int(torch.cuda.max_memory_allocated(self.device)) if self.is_cuda else 0

    def synchronize(self) -> None:
        """Wait for this device's queued work (timings; a no-op on the CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


class Staging:
    """Pinned host buffers, one per key, for one thread's device <-> host copies.

    ``to_host`` returns a CPU tensor valid until the next ``to_host`` of the same key: the
    caller must be done with it (``pack_tensor`` copies it into the frame's bytes) by then.
    ``to_device`` returns a device tensor whose copy may still be running on the device's
    current stream, which orders it before any kernel that later reads it. A frame the
    transport decoded into pinned memory (``TransportConfig.pin_decoded``) goes straight to
    the device: torch's pinned-memory cache records the copy's event and reuses that memory
    only after it. Any other host tensor is first copied into this key's pinned buffer, whose
    next use waits for the previous copy out of it. On the CPU both return their input.
    """

    def __init__(self, compute: Compute) -> None:
        self.compute = compute
        self._host: dict[object, torch.Tensor] = {}
        self._inbound: dict[object, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.staged = 0  # host tensors copied into a staging buffer on their way in

    def to_host(self, key: object, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        buffer = self._buffer(self._host, key, tensor)
        buffer.copy_(tensor, non_blocking=True)
        # The bytes are read by the CPU right after: wait for this copy, not the whole device.
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        done.synchronize()
        return buffer

    def to_device(self, key: object, tensor: torch.Tensor) -> torch.Tensor:
        device = self.compute.device
        if device.type == "cpu" or tensor.device == device:
            return tensor
        if tensor.is_pinned():
            return tensor.to(device, non_blocking=True)
        held = self._inbound.get(key)
        if held is not None and held[1] is not None:
            held[1].synchronize()  # the previous frame's copy out of this buffer is done
        buffer = self._buffer({key: held[0]} if held else {}, key, tensor)
        buffer.copy_(tensor)
        self.staged += 1
        on_device = buffer.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._inbound[key] = (buffer, event)
        return on_device

    @staticmethod
    def _buffer(pool: dict[object, torch.Tensor], key: object, like: torch.Tensor) -> torch.Tensor:
        buffer = pool.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
            pool[key] = buffer
        return buffer


def pins_frames(device: str) -> bool:
    """Whether a node computing on ``device`` (a ``--device`` value) should have its transport
    decode frames into pinned memory (``TransportConfig.pin_decoded``)."""
    return resolve_device(device).type == "cuda"
