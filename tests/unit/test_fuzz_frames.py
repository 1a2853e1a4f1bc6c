"""Thousands of damaged frames: each decodes to a valid tensor or raises FrameError."""

import random

import msgpack
import psutil
import torch

from fusionllm.compression import (
    Float16Codec,
    FrameError,
    FrameLimits,
    IdentityCodec,
    TopKCodec,
    pack_tensor,
    unpack_tensor,
)

LIMITS = FrameLimits(max_elements=1 << 16)
MUTANTS = 12_000


def _seed_frames() -> list[bytes]:
    generator = torch.Generator().manual_seed(1)
    frames = []
    for shape in [(), (0,), (5,), (3, 7), (2, 3, 4), (300,)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            tensor = torch.randn(shape, generator=generator).to(dtype)
            for codec in (IdentityCodec(), Float16Codec(), TopKCodec(0.1), TopKCodec(0.9)):
                frames.append(pack_tensor(tensor, codec))
    frames.append(pack_tensor(torch.arange(10)))
    frames.append(pack_tensor(torch.tensor([True, False])))
    return frames


def _random_value(rng: random.Random):
    choice = rng.randrange(9)
    if choice == 0:
        return rng.randint(-(2**63), 2**64 - 1)
    if choice == 1:
        return rng.choice([0, 1, -1, 7, 2**31, 2**32 + 1])
    if choice == 2:
        return rng.random() * 1e6
    if choice == 3:
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 4:
        return "".join(rng.choice("abcdfi0123_") for _ in range(rng.randrange(0, 10)))
    if choice == 5:
        return [rng.randint(-3, 70) for _ in range(rng.randrange(0, 10))]
    if choice == 6:
        return None
    if choice == 7:
        return {"v": 1}
    return rng.choice([True, False])


def _mutate(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(7)
    raw = bytearray(data)
    if kind == 0 and raw:  # flip bits
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if kind == 1:  # truncate
        return bytes(raw[: rng.randrange(len(raw) + 1)])
    if kind == 2:  # insert or delete a run of bytes
        at = rng.randrange(len(raw) + 1)
        if rng.random() < 0.5:
            return bytes(raw[:at] + rng.randbytes(rng.randint(1, 16)) + raw[at:])
        return bytes(raw[:at] + raw[at + rng.randint(1, 16) :])
    if kind == 3:  # pure noise
        return rng.randbytes(rng.randrange(0, 200))
    frame = msgpack.unpackb(data, raw=False)
    key = rng.choice([*frame.keys(), "extra"])
    if kind == 4:  # a field takes a random value
        frame[key] = _random_value(rng)
    elif kind == 5:  # a field disappears
        frame.pop(key, None)
    else:  # numbers nudged
        for name in ("k", "sh"):
            if name in frame and rng.random() < 0.7:
                if name == "k":
                    frame["k"] = frame["k"] + rng.choice([-1, 1, 1000, -(10**9), 10**12])
                elif frame["sh"]:
                    i = rng.randrange(len(frame["sh"]))
                    frame["sh"][i] = frame["sh"][i] + rng.choice([-1, 1, 10**9, 2**40])
    return msgpack.packb(frame, use_bin_type=True)


def test_damaged_frames_decode_validly_or_raise_frame_error():
    rng = random.Random(20261122)
    seeds = _seed_frames()
    process = psutil.Process()
    rss_before = process.memory_info().rss
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(MUTANTS):
        data = _mutate(rng, rng.choice(seeds))
        try:
            tensor = unpack_tensor(data, limits=LIMITS)
        except FrameError:
            outcomes["refused"] += 1
            continue
        assert isinstance(tensor, torch.Tensor)
        assert tensor.numel() <= LIMITS.max_elements
        if tensor.is_floating_point():
            assert bool(torch.isfinite(tensor).all())
        outcomes["decoded"] += 1
    growth_mb = (process.memory_info().rss - rss_before) / 2**20
    assert growth_mb < 256, f"fuzzing grew RSS by {growth_mb:.0f} MiB"
    # Both outcomes must be exercised, or the mutator is not testing anything.
    assert outcomes["refused"] > MUTANTS // 4
    assert outcomes["decoded"] > 100
