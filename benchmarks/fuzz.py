"""Mutation fuzzing of everything a stranger can send: 0 crashes, 0 untyped errors, bounded memory.

    python benchmarks/fuzz.py [--n 100000] [--seed 12] [--json PATH] [--in-process]

Targets (benchmarks/fuzz_targets.py): tensor frames (every codec; under small limits, and as a
receiver that expects a dtype and shape), transport frame heads, DHT envelopes (re-signed after
damage, so the record parsers behind the signature see it too), the node <-> DHT worker pipe,
gossiped bandwidth reports, training-board frames and plan JSON. Each input is a valid seed
damaged at the byte level (bit flips, interesting integers over length fields, truncation,
insertion, deletion, duplication) or in its structure (a msgpack/JSON field replaced, dropped,
added, nudged to an edge value, grown or nested deep), or both.

Per target: accepted (and passed the target's check), refused with a typed error, untyped
errors (any other exception: a crash of the caller), bad outputs (accepted but wrong), and the
peak allocation of one input: Python's (tracemalloc, peak minus what was live before) and
native (the growth of the process's RSS high-water mark while it ran; torch's allocations are
invisible to tracemalloc). Each target runs in its own process, so a segfault or an abort
counts as a crash instead of ending the run; ``--in-process`` skips that (and the count).
"""

import argparse
import json
import math
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_targets  # a sibling script, found through the path above

PY_PEAK_BOUND = 8 << 20  # bytes of Python allocation for one input
RSS_JUMP_BOUND = 64 << 20  # bytes of RSS high-water growth for one input
_SAMPLES = 5

INTERESTING_INTS = (
    0, 1, -1, 127, 128, 255, 256, 2**15, 2**16 - 1, 2**16, 2**24, 2**28, 2**31 - 1, 2**31,
    2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1,
)  # fmt: skip
INTERESTING_FLOATS = (
    math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, 1e308, -1e308, 5e-324, 2.0**62, 2.0**64,
)  # fmt: skip
# msgpack type bytes that change what follows: big containers, big bins, the never-used 0xc1.
INTERESTING_BYTES = (0x00, 0xFF, 0x7F, 0x80, 0xC1, 0xC6, 0xCE, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF)


# ----------------------------------------------------------------------------- mutators


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    raw = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        raw = _BYTE_OPS[rng.randrange(len(_BYTE_OPS))](rng, raw)
    return bytes(raw)


def _flip(rng: random.Random, raw: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        if raw:
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    return raw


def _interesting_byte(rng: random.Random, raw: bytearray) -> bytearray:
    if raw:
        raw[rng.randrange(len(raw))] = rng.choice(INTERESTING_BYTES)
    return raw


def _interesting_int(rng: random.Random, raw: bytearray) -> bytearray:
    width = rng.choice((1, 2, 4, 8))
    value = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
    at = rng.randrange(len(raw) + 1)
    raw[at : at + width] = value.to_bytes(width, "big")
    return raw


def _truncate(rng: random.Random, raw: bytearray) -> bytearray:
    return raw[: rng.randrange(len(raw) + 1)]


def _insert(rng: random.Random, raw: bytearray) -> bytearray:
    at = rng.randrange(len(raw) + 1)
    return raw[:at] + rng.randbytes(rng.randint(1, 32)) + raw[at:]


def _delete(rng: random.Random, raw: bytearray) -> bytearray:
    at = rng.randrange(len(raw) + 1)
    return raw[:at] + raw[at + rng.randint(1, 32) :]


def _duplicate(rng: random.Random, raw: bytearray) -> bytearray:
    if not raw:
        return raw
    start = rng.randrange(len(raw))
    run = raw[start : start + rng.randint(1, 64)]
    at = rng.randrange(len(raw) + 1)
    return raw[:at] + run * rng.randint(1, 8) + raw[at:]


def _noise(rng: random.Random, raw: bytearray) -> bytearray:
    return bytearray(rng.randbytes(rng.randrange(0, 256)))


_BYTE_OPS = (
    _flip, _flip, _interesting_byte, _interesting_int, _interesting_int, _truncate, _insert,
    _delete, _duplicate, _noise,
)  # fmt: skip


def random_value(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(12)
    if choice == 0:
        return rng.choice(INTERESTING_INTS)
    if choice == 1:
        return rng.choice(INTERESTING_FLOATS)
    if choice == 2:
        return rng.randint(-1000, 1000)
    if choice == 3:
        return rng.random() * 10.0 ** rng.randint(-5, 12)
    if choice == 4:
        return rng.randbytes(rng.choice((0, 1, 7, 64, 1000)))
    if choice == 5:
        return "".join(rng.choice("abcdfiv0123_/.:é") for _ in range(rng.choice((0, 1, 8, 300))))
    if choice == 6 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if choice == 7 and depth < 3:
        return {rng.choice("vcdtshkpxyz"): random_value(rng, depth + 1) for _ in range(3)}
    if choice == 8:
        return None
    if choice == 9:
        return rng.choice((True, False))
    return rng.choice(("float32", "topk", "node", "plan", "activation", "int64", "bool", ""))


def _positions(tree: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in ``tree``; (None, None) stands for the root."""
    found: list[tuple[Any, Any]] = [(None, None)]
    stack = [tree]
    while stack and len(found) < 4096:
        node = stack.pop()
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, child in items:
            found.append((node, key))
            if isinstance(child, dict | list):
                stack.append(child)
    return found


def _nudged(rng: random.Random, value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice(
            (value + 1, value - 1, -value, value * 2 ** rng.randint(1, 40), 0, 2**64 - 1)
        )
    if isinstance(value, float):
        return rng.choice((value * 1e30, -value, math.nan, math.inf, float(int(value)) + 0.5, 0.0))
    if isinstance(value, str | bytes):
        return value * rng.randint(2, 50) if value else value
    if isinstance(value, list):
        return value * rng.randint(2, 40) if value else [random_value(rng)]
    return random_value(rng)


def mutate_tree(rng: random.Random, tree: Any) -> Any:
    """One structural change somewhere in a msgpack/JSON tree (changed in place; the root
    may be replaced, so use the return value)."""
    container, key = rng.choice(_positions(tree))
    value = tree if container is None else container[key]
    op = rng.randrange(7)
    if op == 0:
        new = random_value(rng)
    elif op in (1, 2):
        new = _nudged(rng, value)
    elif op == 3 and container is not None:  # drop it
        del container[key]
        return tree
    elif op == 4 and isinstance(value, dict):  # an extra key
        value[rng.choice(("extra", "v", "sh", "k", 0, "body"))] = random_value(rng)
        return tree
    elif op == 5:  # nested deep
        new = value
        for _ in range(rng.choice((2, 50, 500))):
            new = [new]
    else:  # a type swap
        new = (
            {int: float, float: str, str: bytes, bytes: str}.get(type(value), list)(
                value if not isinstance(value, bytes) else value.decode("latin-1")
            )
            if not isinstance(value, dict)
            else list(value)
        )
    if container is None:
        return new
    container[key] = new
    return tree


def mutate(rng: random.Random, target: "fuzz_targets.Target", data: bytes) -> tuple[bytes, str]:
    """A damaged copy of ``data`` and how it was damaged ("bytes", "tree", "tree+bytes")."""
    roll = rng.random()
    if target.tree is not None and roll < 0.6:
        decode, encode = target.tree
        try:
            tree = decode(data)
            if target.special is not None and rng.random() < 0.15:
                tree = target.special(rng, tree)
            for _ in range(rng.choice((0, 1, 1, 2, 3))):
                tree = mutate_tree(rng, tree)
            damaged = encode(tree)
        except (ValueError, TypeError, OverflowError, RecursionError, KeyError, AttributeError):
            return mutate_bytes(rng, data), "bytes"  # the tree would not encode: bytes instead
        if roll < 0.45:
            return damaged, "tree"
        return mutate_bytes(rng, damaged), "tree+bytes"
    return mutate_bytes(rng, data), "bytes"


# ----------------------------------------------------------------------------- the runner


@dataclass
class Tally:
    target: str
    inputs: int = 0
    accepted: int = 0
    refused: int = 0
    untyped: int = 0  # an exception not among the target's typed errors
    bad_output: int = 0  # accepted, but failed the target's check
    over_bound: int = 0  # one input's peak allocation over PY_PEAK_BOUND or RSS_JUMP_BOUND
    crashed: int = 0  # the target's process died
    py_peak_max: int = 0
    py_peak_median: float = 0.0
    rss_jump_max: int = 0
    us_per_input_median: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)

    def note(self, kind: str, exc: BaseException | str, data: bytes, how: str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if sum(s["kind"] == kind for s in self.samples) < _SAMPLES:
            self.samples.append(
                {"kind": kind, "error": text[:300], "how": how, "input": data[:96].hex()}
            )


def run_target(target: "fuzz_targets.Target", n: int, seed: int) -> Tally:
    rng = random.Random(f"{seed}/{target.name}")
    tally = Tally(target=target.name)
    py_peaks, times = [], []
    rss = PeakRss()
    tracemalloc.start()
    try:
        for _ in range(n):
            data, context = rng.choice(target.seeds)
            damaged, how = mutate(rng, target, data)
            py_peak, rss_jump, seconds = _one(target, tally, damaged, context, how, rss)
            py_peaks.append(py_peak)
            times.append(seconds)
            tally.rss_jump_max = max(tally.rss_jump_max, rss_jump)
            if py_peak > PY_PEAK_BOUND or rss_jump > RSS_JUMP_BOUND:
                tally.over_bound += 1
                tally.note("over bound", f"python {py_peak} B, rss +{rss_jump} B", damaged, how)
    finally:
        tracemalloc.stop()
    tally.inputs = n
    tally.py_peak_max = max(py_peaks, default=0)
    tally.py_peak_median = statistics.median(py_peaks) if py_peaks else 0.0
    tally.us_per_input_median = 1e6 * statistics.median(times) if times else 0.0
    return tally


class PeakRss:
    """The RSS high-water mark, reset before each input where Linux allows (writing 5 to
    /proc/self/clear_refs resets VmHWM): without the reset only the first big allocation of
    a run would show, as the mark never comes down."""

    def __init__(self) -> None:
        self.resettable = self._reset()

    def start(self) -> int:
        """Reset the mark; the bytes resident now, to measure the peak against."""
        if self.resettable:
            self._reset()
            return self._status("VmRSS")
        return self.peak()

    def peak(self) -> int:
        if self.resettable:
            return self._status("VmHWM")
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status(field_name: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"no {field_name} in /proc/self/status")


def _one(
    target, tally: Tally, data: bytes, context: Any, how: str, rss: PeakRss
) -> tuple[int, int, float]:
    rss_before = rss.start()  # first: its own reads of /proc stay out of the Python peak
    tracemalloc.reset_peak()
    live_before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    try:
        out = target.decode(data, context)
    except target.allowed:
        tally.refused += 1
    except Exception as exc:
        tally.untyped += 1
        tally.note("untyped", exc, data, how)
    else:
        try:
            target.check(out, context)
            tally.accepted += 1
        except AssertionError as exc:
            tally.bad_output += 1
            tally.note("bad output", f"AssertionError: {exc}", data, how)
        del out
    seconds = time.perf_counter() - started
    py_peak = tracemalloc.get_traced_memory()[1] - live_before
    rss_peak = rss.peak()
    return max(0, py_peak), max(0, rss_peak - rss_before), seconds


# ----------------------------------------------------------------------------- the command


def _run_isolated(name: str, n: int, seed: int) -> Tally:
    """One target in a child process: a crash there is counted, not fatal."""
    command = [sys.executable, __file__, "--child", name, "--n", str(n), "--seed", str(seed)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return Tally(**json.loads(lines[-1]))
    tally = Tally(target=name, inputs=n, crashed=1)
    tally.note("crash", f"exit {done.returncode}: {done.stderr[-300:]}", b"", "")
    return tally


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def run_all(n: int, seed: int, *, isolated: bool) -> list[Tally]:
    targets = fuzz_targets.all_targets()
    shares = split(n, len(targets))
    if isolated:
        return [
            _run_isolated(t.name, share, seed) for t, share in zip(targets, shares, strict=True)
        ]
    return [run_target(t, share, seed) for t, share in zip(targets, shares, strict=True)]


def print_table(tallies: list[Tally], seconds: float) -> None:
    head = (
        f"{'target':<24} {'inputs':>7} {'accepted':>8} {'refused':>8} {'untyped':>7} "
        f"{'bad out':>7} {'crash':>5} {'py peak max':>11} {'py p50':>7} {'rss jump':>8} "
        f"{'us p50':>7}"
    )
    print(head)
    print("-" * len(head))
    for t in [*tallies, _total(tallies)]:
        print(
            f"{t.target:<24} {t.inputs:>7} {t.accepted:>8} {t.refused:>8} {t.untyped:>7} "
            f"{t.bad_output:>7} {t.crashed:>5} {t.py_peak_max / 1024:>9.0f}Ki "
            f"{t.py_peak_median / 1024:>5.1f}Ki {t.rss_jump_max / 2**20:>6.1f}Mi "
            f"{t.us_per_input_median:>7.0f}"
        )
    print(
        f"{seconds:.0f} s; bounds per input: python {PY_PEAK_BOUND >> 20} MiB, "
        f"rss {RSS_JUMP_BOUND >> 20} MiB"
    )
    for t in tallies:
        for sample in t.samples:
            print(f"  {t.target}: {sample['kind']} ({sample['how']}): {sample['error'][:160]}")


def _total(tallies: list[Tally]) -> Tally:
    total = Tally(target="all")
    for t in tallies:
        for name in (
            "inputs",
            "accepted",
            "refused",
            "untyped",
            "bad_output",
            "over_bound",
            "crashed",
        ):
            setattr(total, name, getattr(total, name) + getattr(t, name))
        total.py_peak_max = max(total.py_peak_max, t.py_peak_max)
        total.rss_jump_max = max(total.rss_jump_max, t.rss_jump_max)
    total.py_peak_median = statistics.median(t.py_peak_median for t in tallies) if tallies else 0
    total.us_per_input_median = (
        statistics.median(t.us_per_input_median for t in tallies) if tallies else 0
    )
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="inputs in all, split over targets")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--json", help="write the tallies here")
    parser.add_argument("--in-process", action="store_true", help="no child process per target")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        target = next(t for t in fuzz_targets.all_targets() if t.name == args.child)
        print(json.dumps(asdict(run_target(target, args.n, args.seed))))
        return
    started = time.perf_counter()
    tallies = run_all(args.n, args.seed, isolated=not args.in_process)
    seconds = time.perf_counter() - started
    print_table(tallies, seconds)
    total = _total(tallies)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "n": args.n,
                    "seed": args.seed,
                    "seconds": seconds,
                    "machine": platform.platform(),
                    "bounds": {"python_bytes": PY_PEAK_BOUND, "rss_bytes": RSS_JUMP_BOUND},
                    "total": asdict(total),
                    "targets": [asdict(t) for t in tallies],
                },
                indent=1,
            )
        )
    failed = total.untyped + total.bad_output + total.over_bound + total.crashed
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
