"""Decoding a received dense or half-precision frame: this decode against the one it replaced;
and packing a half link's frame: scaled float16 against the bfloat16 it replaced.

    python benchmarks/frame_decode.py [--mib M] [--rounds R] [--json PATH]

The old decode copied the payload bytes into a tensor of the wire dtype with numpy, then (a
half frame) converted that into a second tensor of the frame's dtype: two host passes and two
allocations for fp16/bf16. The new one views the payload (no copy) and writes the frame's
tensor once, converting on the way. Each round times the old and the new decode of the same
frame, alternately, from the same reused receive buffer; the table shows medians over the
rounds and new / old (below 1.0: faster). The last row packs a half link's frame: before,
``Float16Codec(bfloat16)`` (a cast and a finiteness pass); now ``Float16Codec(float16)`` (one
min/max pass for the scale, then the scaled cast).
"""

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch

from fusionllm.compression import Float16Codec, decode_frame, pack_tensor, parse_frame
from fusionllm.compression.codecs import check_finite
from fusionllm.compression.dtypes import WIRE_DTYPES

CASES = (("dense float32", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16))


def old_decode(parsed) -> torch.Tensor:
    """The decode before the one-copy change (codecs.py at b6d9a8c), for dense and f16."""
    frame, target = parsed.fields, parsed.target
    wire = WIRE_DTYPES[frame["wd"]] if "wd" in frame else target.dtype
    flat = torch.empty(target.numel, dtype=wire)
    flat.view(torch.uint8).numpy()[:] = np.frombuffer(frame["p"], dtype=np.uint8)
    check_finite(flat, parsed.limits)
    out = flat.view(target.shape).to(dtype=target.dtype)
    if frame.get("e"):  # the old frames had no scale; applied so the results compare
        out.mul_(2.0 ** -frame["e"])
    return out


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(mib: int, rounds: int) -> list[dict]:
    numel = (mib << 20) // 4
    source = torch.randn(numel)  # (N,)
    rows = []
    for name, half in CASES:
        body = bytearray(pack_tensor(source, Float16Codec(half) if half else None))
        parsed = parse_frame(memoryview(body))
        assert torch.equal(old_decode(parsed), decode_frame(parsed)), name
        old, new = [], []
        for _ in range(rounds):
            old.append(_seconds(lambda p=parsed: old_decode(p)))
            new.append(_seconds(lambda p=parsed: decode_frame(p)))
        old_s, new_s = statistics.median(old), statistics.median(new)
        rows.append({"frame": name, "mib": mib, "old_ms": old_s * 1e3, "new_ms": new_s * 1e3,
                     "new_over_old": new_s / old_s})  # fmt: skip
    old, new = [], []
    for _ in range(rounds):
        old.append(_seconds(lambda: pack_tensor(source, Float16Codec(torch.bfloat16))))
        new.append(_seconds(lambda: pack_tensor(source, Float16Codec(torch.float16))))
    old_s, new_s = statistics.median(old), statistics.median(new)
    rows.append({"frame": "pack half", "mib": mib, "old_ms": old_s * 1e3, "new_ms": new_s * 1e3,
                 "new_over_old": new_s / old_s})  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="float32 size of the tensor (MiB)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (median)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = measure(args.mib, args.rounds)
    print(f"{'frame':<14} {'MiB':>5} {'old ms':>8} {'new ms':>8} {'new/old':>8}")
    for r in rows:
        print(f"{r['frame']:<14} {r['mib']:>5} {r['old_ms']:>8.1f} {r['new_ms']:>8.1f} "
              f"{r['new_over_old']:>8.2f}")  # fmt: skip
    if args.json:
        meta = {"machine": platform.machine(), "threads": torch.get_num_threads()}
        with open(args.json, "w") as out:
            json.dump({"meta": meta, "rows": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
