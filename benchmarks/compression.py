"""Top-k compression speed against torch.topk and memcpy, measured in the same run.

    python benchmarks/compression.py [--numel N] [--repeats R] [--json PATH] [--check]

Every round times each variant once, interleaved, so machine noise hits all of them alike;
the table shows medians over the rounds and the ratios the targets are stated in.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import msgpack
import torch

from fusionllm.compression import TopKCodec, pack_tensor, topk_count, unpack_tensor
from fusionllm.compression.codecs import tensor_bytes

RATIOS = (0.001, 0.01, 0.1)
TARGETS = {
    "encode_vs_torch_topk_at_0.01": 5.0,
    "encode_vs_memcpy_at_0.01": 0.5,
    "decode_vs_memcpy_min": 0.5,
    "frame_overhead_pct_max": 1.0,
}


def encode_with_torch_topk(tensor: torch.Tensor, ratio: float) -> bytes:
    """The baseline: the same frame, with the selection done by torch.topk."""
    flat = tensor.reshape(-1)
    k = topk_count(flat.numel(), ratio)
    indices = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    frame = {
        "v": 1,
        "c": "topk",
        "dt": "float32",
        "sh": list(tensor.shape),
        "wd": "float16",
        "k": k,
        "ix": "i32",
        "p": tensor_bytes(flat[indices].half()),
        "ixp": tensor_bytes(indices.int()),
    }
    return msgpack.packb(frame, use_bin_type=True)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def payload_bytes(frame: bytes) -> int:
    fields = msgpack.unpackb(frame, raw=False)
    return sum(len(v) for v in fields.values() if isinstance(v, bytes))


def _time_codecs(tensor: torch.Tensor, frames: dict, repeats: int) -> dict[str, float]:
    """MB/s per operation (median of ``repeats`` rounds, each operation once a round)."""
    timings: dict[str, list[float]] = {"memcpy": []}
    for ratio in RATIOS:
        for name in ("encode", "decode", "torch_topk_encode"):
            timings[f"{name}@{ratio}"] = []
    for round_index in range(repeats):
        timings["memcpy"].append(_seconds(tensor.clone))
        for ratio in RATIOS:
            codec = TopKCodec(ratio)
            timings[f"encode@{ratio}"].append(_seconds(lambda c=codec: pack_tensor(tensor, c)))
            timings[f"decode@{ratio}"].append(_seconds(lambda f=frames[ratio]: unpack_tensor(f)))
            timings[f"torch_topk_encode@{ratio}"].append(
                _seconds(lambda r=ratio: encode_with_torch_topk(tensor, r))
            )
        print(f"round {round_index + 1}/{repeats} done", file=sys.stderr)
    mb = tensor.numel() * 4 / 1e6
    return {key: mb / statistics.median(values) for key, values in timings.items()}


def _ratio_row(ratio: float, frame: bytes, numel: int, speed: dict[str, float]) -> dict:
    payload = payload_bytes(frame)
    dense_bytes = numel * 4
    return {
        "ratio": ratio,
        "k": topk_count(numel, ratio),
        "wire_bytes": len(frame),
        "wire_vs_dense": len(frame) / dense_bytes,
        "frame_overhead_pct": 100 * (len(frame) - payload) / payload,
        "encode_mb_s": speed[f"encode@{ratio}"],
        "decode_mb_s": speed[f"decode@{ratio}"],
        "torch_topk_encode_mb_s": speed[f"torch_topk_encode@{ratio}"],
        "encode_vs_torch_topk": speed[f"encode@{ratio}"] / speed[f"torch_topk_encode@{ratio}"],
        "encode_vs_memcpy": speed[f"encode@{ratio}"] / speed["memcpy"],
        "decode_vs_memcpy": speed[f"decode@{ratio}"] / speed["memcpy"],
    }


def run(numel: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(numel, generator=generator)  # (N,) fp32
    dense_bytes = numel * 4
    frames = {ratio: pack_tensor(tensor, TopKCodec(ratio)) for ratio in RATIOS}
    speed = _time_codecs(tensor, frames, repeats)
    rows = [_ratio_row(ratio, frames[ratio], numel, speed) for ratio in RATIOS]
    dense_frame = pack_tensor(tensor[: 1 << 18])  # 1 MiB, the smallest size the target covers
    dense_overhead = 100 * (len(dense_frame) - (1 << 20)) / (1 << 20)
    at_001 = next(row for row in rows if row["ratio"] == 0.01)
    checks = {
        "encode >= 5x torch.topk at 0.01": at_001["encode_vs_torch_topk"]
        >= TARGETS["encode_vs_torch_topk_at_0.01"],
        "encode >= 0.5x memcpy at 0.01": at_001["encode_vs_memcpy"]
        >= TARGETS["encode_vs_memcpy_at_0.01"],
        "decode >= 0.5x memcpy (every ratio)": min(r["decode_vs_memcpy"] for r in rows)
        >= TARGETS["decode_vs_memcpy_min"],
        "frame overhead < 1% (tensors >= 1 MiB)": max(
            dense_overhead, *(r["frame_overhead_pct"] for r in rows)
        )
        < TARGETS["frame_overhead_pct_max"],
    }
    return {
        "numel": numel,
        "dense_bytes": dense_bytes,
        "repeats": repeats,
        "memcpy_mb_s": speed["memcpy"],
        "dense_1mib_frame_overhead_pct": dense_overhead,
        "rows": rows,
        "checks": checks,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        },
    }


def format_table(result: dict) -> str:
    lines = [
        f"top-k on {result['numel']:,} fp32 ({result['dense_bytes'] / 1e6:.0f} MB), medians of "
        f"{result['repeats']} rounds; memcpy (clone) {result['memcpy_mb_s']:.0f} MB/s",
        "",
        f"{'ratio':>6} {'k':>9} {'wire bytes':>11} {'wire/dense':>10} {'ovh %':>6} "
        f"{'enc MB/s':>9} {'dec MB/s':>9} {'topk MB/s':>9} {'enc/topk':>8} {'enc/cpy':>7} "
        f"{'dec/cpy':>7}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['ratio']:>6g} {r['k']:>9,} {r['wire_bytes']:>11,} {r['wire_vs_dense']:>10.4f} "
            f"{r['frame_overhead_pct']:>6.3f} {r['encode_mb_s']:>9.0f} {r['decode_mb_s']:>9.0f} "
            f"{r['torch_topk_encode_mb_s']:>9.0f} {r['encode_vs_torch_topk']:>8.1f} "
            f"{r['encode_vs_memcpy']:>7.2f} {r['decode_vs_memcpy']:>7.2f}"
        )
    lines.append(
        f"\ndense 1 MiB frame overhead: {result['dense_1mib_frame_overhead_pct']:.4f} % of payload"
    )
    lines.append("")
    for name, ok in result["checks"].items():
        lines.append(f"  [{'PASS' if ok else 'MISS'}] {name}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements (default 16M)")
    parser.add_argument("--repeats", type=int, default=9, help="rounds (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args()
    if args.numel < 1 << 18 or args.repeats < 1:
        parser.error("--numel must be >= 262144 and --repeats >= 1")
    result = run(args.numel, args.repeats)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0 if (not args.check or all(result["checks"].values())) else 1


if __name__ == "__main__":
    sys.exit(main())
