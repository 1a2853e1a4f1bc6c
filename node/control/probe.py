"""Measure what this machine's device can do: matmul FLOP/s, memory bandwidth, per-op overhead.

The planner needs achievable numbers, not datasheet peaks, so a node times a short matmul,
element-wise training layers and tiny layers on its own device. Results are cached per device
(name, torch version) in a JSON file so restarts do not pay for the measurement again.
"""

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import PRECISIONS
from fusionllm.dht.records import DeviceInfo
from fusionllm.node.control.frame_beside import BesideConfig, measure_frame_beside_compute
from fusionllm.node.control.frame_cost import (
    FrameProbeConfig,
    measure_frame_overhead,
    measure_topk_cost,
)
from fusionllm.node.devices import resolve_device

logger = get_logger(__name__)

# 3: measured at the run's precision, on the device that trains; 4: the fastest repeat counts;
# 5: with the per-frame cost; 7: a frame's cost measured beside compute (frame_beside.py)
_PROBE_VERSION = 7
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class DeviceMeasurement:
    """What one device measured: FLOP/s on fp32 matmuls, the bandwidth element-wise training
    kernels achieve, memory size, and the fixed cost of one operator."""

    device_name: str
    flops: float
    memory_bandwidth: float
    memory_bytes: int
    op_overhead: float  # seconds per operator per pass (forward or backward) on tiny layers
    frame_overhead: float = 0.0  # seconds of CPU per tensor frame, one side (frame_cost.py)
    topk_frame_overhead: float = 0.0  # a top-k frame, one side: s per frame (frame_cost.py)
    topk_byte_cost: float = 0.0  # ... plus s per byte of the dense tensor it packs


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    matmul_size: int = 1024
    elementwise_bytes: int = 16 << 20
    repeats: int = 5
    dtype: torch.dtype = torch.float32
    overhead_ops: int = 64

    def __post_init__(self) -> None:
        if not 64 <= self.matmul_size <= 16384:
            raise ConfigError(f"matmul_size must be in [64, 16384], got {self.matmul_size}")
        if not 1 << 16 <= self.elementwise_bytes <= 4 << 30:
            raise ConfigError(
                f"elementwise_bytes must be in [64 KiB, 4 GiB], got {self.elementwise_bytes}"
            )
        if not 1 <= self.repeats <= 100:
            raise ConfigError(f"repeats must be in [1, 100], got {self.repeats}")
        if not 1 <= self.overhead_ops <= 10_000:
            raise ConfigError(f"overhead_ops must be in [1, 10000], got {self.overhead_ops}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} cpu"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def undisturbed_seconds(times: list[float]) -> float:
    """What the work takes when the device is ours: the fastest repeat. A repeat can only be
    slowed (another process on the core, a throttled cgroup period), never sped up, so the
    median of repeats measured on a loaded machine read the load: on the testbed at load
    average ~15 one thread read 29.8 GFLOP/s and 139 us per operator, against 52.4 and 21 us
    at load 2-9, and plans came out 1.64x pessimistic (docs/testbed.md)."""
    if not times or not all(t > 0 for t in times):
        raise ValueError(f"need positive repeat times, got {times}")
    return min(times)


def _fastest_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocations, kernel selection
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return undisturbed_seconds(times)


def _tiny_layers(device: torch.device, ops: int) -> torch.nn.Module:
    """Linear, LayerNorm and GELU in turn, as in a transformer: a plain multiply chain costs
    4 us per op here, these 16 us, which is what a traced model's operators pay."""
    kinds = (
        lambda: torch.nn.Linear(8, 8),
        lambda: torch.nn.LayerNorm(8),
        torch.nn.GELU,
    )
    return torch.nn.Sequential(*(kinds[i % 3]() for i in range(ops))).to(device)


def _forward_backward(layers: torch.nn.Module, x: torch.Tensor) -> None:
    layers(x).sum().backward()


def measure_device(
    device: torch.device | str, config: ProbeConfig | None = None
) -> DeviceMeasurement:
    """Time a square matmul, element-wise layers and tiny layers on ``device`` (~1 s on a CPU)."""
    config = config if config is not None else ProbeConfig()
    device = torch.device(device)
    n = config.matmul_size
    a = torch.randn(n, n, device=device, dtype=config.dtype)  # (n, n)
    b = torch.randn(n, n, device=device, dtype=config.dtype)  # (n, n)
    matmul_s = _fastest_seconds(lambda: torch.mm(a, b), device, config.repeats)
    # Memory-bound work as training does it (a norm and an activation, forward and backward),
    # counted the way the estimator counts traffic: a pass moves an op's output once forward
    # and twice backward. A bare copy reads 3-6x faster than these kernels achieve.
    width = 4096
    rows = max(1, config.elementwise_bytes // (4 * width))
    x = torch.randn(rows, width, device=device, requires_grad=True)  # (R, W)
    norm = torch.nn.LayerNorm(width).to(device)
    activation = torch.nn.GELU()
    with torch.autocast(device.type, dtype=config.dtype, enabled=config.dtype != torch.float32):
        # What autocast runs (its lists keep layer norm in fp32): the kernels a stage runs.
        elementwise_s = _fastest_seconds(
            lambda: activation(norm(x)).sum().backward(), device, config.repeats
        )
    elementwise_traffic = 2 * 3 * x.numel() * 4
    layers = _tiny_layers(device, config.overhead_ops)
    tiny = torch.ones(4, 8, device=device)  # (B, C): too small for the arithmetic to count
    overhead_s = _fastest_seconds(lambda: _forward_backward(layers, tiny), device, config.repeats)
    if device.type == "cuda":
        memory_bytes = torch.cuda.get_device_properties(device).total_memory
    else:
        memory_bytes = psutil.virtual_memory().total
    topk = measure_topk_cost(rounds=min(config.repeats, 3))
    alone = measure_frame_overhead(FrameProbeConfig(repeats=config.repeats))
    # A frame beside compute costs its path too (TCP, the reader thread, the cache it takes):
    # the top-k frame pays that path beside its codec, so its constant carries the excess.
    beside = max(measure_frame_beside_compute(BesideConfig(rounds=config.repeats)), alone)
    measurement = DeviceMeasurement(
        device_name=device_name(device),
        flops=2 * n**3 / matmul_s,
        memory_bandwidth=elementwise_traffic / elementwise_s,
        memory_bytes=int(memory_bytes),
        op_overhead=overhead_s / (2 * config.overhead_ops),
        frame_overhead=beside,
        topk_frame_overhead=topk.per_frame + beside - alone,
        topk_byte_cost=topk.per_byte,
    )
    logger.info(
        "%s: %.1f GFLOP/s %s matmul, %.1f GB/s element-wise, %.1f GiB, %.1f us per op, "
        "%.0f us per frame, top-k %.0f us + %.0f MB/s",
        measurement.device_name,
        measurement.flops / 1e9,
        str(config.dtype).removeprefix("torch."),
        measurement.memory_bandwidth / 1e9,
        measurement.memory_bytes / 2**30,
        measurement.op_overhead * 1e6,
        measurement.frame_overhead * 1e6,
        measurement.topk_frame_overhead * 1e6,
        1e-6 / measurement.topk_byte_cost if measurement.topk_byte_cost else float("inf"),
    )
    return measurement


def cached_measurement(
    device: torch.device | str, cache_path: Path, config: ProbeConfig | None = None
) -> DeviceMeasurement:
    """The cached measurement for this device and torch version, measuring on a miss."""
    device = torch.device(device)
    dtype = (config or ProbeConfig()).dtype
    key = f"v{_PROBE_VERSION}|{device_name(device)}|{device}|{dtype}|torch {torch.__version__}"
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
        # A unique temp name: nodes sharing a cache (or a restarted container, always PID 1)
        # never write through one another's half-written file.
        write_atomic(cache_path, json.dumps(cache, indent=1).encode())
    except OSError as exc:
        logger.warning("could not write probe cache %s: %s", cache_path, exc)
    return measurement


def local_device(cache: Path | None, device: str = "auto", precision: str = "fp32") -> DeviceInfo:
    """The device our stages train on (``--device``), at the run's precision (matmuls in its
    dtype, element-wise work under its autocast), measured once and cached (a few seconds on
    first start): the planner then plans for what this node will really run."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    resolved = resolve_device(device)
    cache = cache or Path.home() / ".cache" / "fusionllm" / "device.json"
    measured = cached_measurement(resolved, cache, ProbeConfig(dtype=_DTYPES[precision]))
    return DeviceInfo(
        name=measured.device_name[:128],
        kind=resolved.type,
        memory_bytes=measured.memory_bytes,
        flops=measured.flops,
        memory_bandwidth=measured.memory_bandwidth,
        op_overhead=measured.op_overhead,
        frame_overhead=measured.frame_overhead,
        topk_frame_overhead=measured.topk_frame_overhead,
        topk_byte_cost=measured.topk_byte_cost,
        cpu_cores=os.cpu_count() or 1,
        ram_bytes=psutil.virtual_memory().total,
    )
