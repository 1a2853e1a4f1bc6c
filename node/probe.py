"""Measure what this machine's device can do: matmul FLOP/s, memory bandwidth, capacity.

The planner needs achievable numbers, not datasheet peaks, so a node times a short matmul and a
large copy on its own device. Results are cached per device (name, torch version) in a JSON
file so restarts do not pay for the measurement again.
"""

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger

logger = get_logger(__name__)

_PROBE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class DeviceMeasurement:
    """What one device measured: FLOP/s on fp32 matmuls, copy bandwidth, memory size."""

    device_name: str
    flops: float
    memory_bandwidth: float
    memory_bytes: int


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    matmul_size: int = 1024
    copy_bytes: int = 64 << 20
    repeats: int = 5
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not 64 <= self.matmul_size <= 16384:
            raise ConfigError(f"matmul_size must be in [64, 16384], got {self.matmul_size}")
        if not 1 << 20 <= self.copy_bytes <= 4 << 30:
            raise ConfigError(f"copy_bytes must be in [1 MiB, 4 GiB], got {self.copy_bytes}")
        if not 1 <= self.repeats <= 100:
            raise ConfigError(f"repeats must be in [1, 100], got {self.repeats}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} cpu"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocations, kernel selection
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_device(
    device: torch.device | str, config: ProbeConfig | None = None
) -> DeviceMeasurement:
    """Time a square matmul and a large copy on ``device`` (about a second on a CPU)."""
    config = config if config is not None else ProbeConfig()
    device = torch.device(device)
    n = config.matmul_size
    a = torch.randn(n, n, device=device, dtype=config.dtype)  # (n, n)
    b = torch.randn(n, n, device=device, dtype=config.dtype)  # (n, n)
    matmul_s = _median_seconds(lambda: torch.mm(a, b), device, config.repeats)
    numel = config.copy_bytes // 4
    source = torch.ones(numel, device=device)  # touched: untouched pages read as the zero page
    target = torch.empty_like(source)
    copy_s = _median_seconds(lambda: target.copy_(source), device, config.repeats)
    if device.type == "cuda":
        memory_bytes = torch.cuda.get_device_properties(device).total_memory
    else:
        memory_bytes = psutil.virtual_memory().total
    measurement = DeviceMeasurement(
        device_name=device_name(device),
        flops=2 * n**3 / matmul_s,
        memory_bandwidth=2 * numel * 4 / copy_s,  # read + write
        memory_bytes=int(memory_bytes),
    )
    logger.info(
        "%s: %.1f GFLOP/s fp32 matmul, %.1f GB/s copy, %.1f GiB memory",
        measurement.device_name,
        measurement.flops / 1e9,
        measurement.memory_bandwidth / 1e9,
        measurement.memory_bytes / 2**30,
    )
    return measurement


def cached_measurement(
    device: torch.device | str, cache_path: Path, config: ProbeConfig | None = None
) -> DeviceMeasurement:
    """The cached measurement for this device and torch version, measuring on a miss."""
    device = torch.device(device)
    key = f"v{_PROBE_VERSION}|{device_name(device)}|{device.type}|torch {torch.__version__}"
    cache: dict[str, dict] = {}
    if cache_path.exists():
        try:
            cache = json.loads(cache_path.read_text())
            if key in cache:
                return DeviceMeasurement(**cache[key])
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("ignoring unreadable probe cache %s: %s", cache_path, exc)
            cache = {}
    measurement = measure_device(device, config)
    cache[key] = asdict(measurement)
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(cache_path)
    except OSError as exc:
        logger.warning("could not write probe cache %s: %s", cache_path, exc)
    return measurement
