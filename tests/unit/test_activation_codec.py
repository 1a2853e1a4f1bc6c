"""The ternary activation codec: round trips, its byte budget, and refusal of malformed frames."""

import math
import random

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.compression import (
    AdaTopK,
    AdaTopKConfig,
    ErrorFeedback,
    FrameError,
    FrameLimits,
    IdentityCodec,
    TernaryCodec,
    TopKCodec,
    activation_codec,
    budget_codec,
    pack_tensor,
    ternary_group_for,
    ternary_wire_bytes,
    topk_wire_bytes,
    unpack_tensor,
)

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
shapes = st.lists(st.integers(min_value=0, max_value=9), min_size=0, max_size=3).map(tuple)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _frame(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def _repack(frame: dict) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


@settings(max_examples=80, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(FLOAT_DTYPES),
    group=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_round_trip_gives_three_levels_per_group(shape, dtype, group, seed):
    tensor = _tensor(shape, dtype, seed)
    codec = TernaryCodec(group)
    decoded = unpack_tensor(pack_tensor(tensor, codec))
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    flat, out = tensor.reshape(-1).double(), decoded.reshape(-1).double()
    for start in range(0, flat.numel(), group):
        x, y = flat[start : start + group], out[start : start + group]
        scale = float(y.abs().max())
        # Each element decodes to 0 or to the group's scale with its own sign.
        assert bool(((y == 0) | (y.abs() == scale)).all())
        assert bool((torch.sign(y) * torch.sign(x) >= 0).all())
        # A symmetric three-level code never does worse than sending zeros.
        assert float((y - x).pow(2).sum()) <= float(x.pow(2).sum()) * (1 + 1e-2) + 1e-12


def test_residual_is_what_the_receiver_misses():
    tensor = torch.randn(3, 50)
    _fields, residual = TernaryCodec(16).encode_with_residual(tensor)
    decoded = unpack_tensor(pack_tensor(tensor, TernaryCodec(16)))
    torch.testing.assert_close(residual, tensor - decoded, rtol=0, atol=1e-6)


def test_error_feedback_with_the_ternary_code_tracks_the_running_sum():
    generator = torch.Generator().manual_seed(3)
    feedback, codec = ErrorFeedback(), TernaryCodec(8)
    sent, received = torch.zeros(64), torch.zeros(64)
    for _ in range(30):
        tensor = torch.randn(64, generator=generator)
        sent += tensor
        received += unpack_tensor(feedback.pack("g", tensor, codec))
    # The gap is exactly the held residual, which stays bounded (about one tensor's size).
    torch.testing.assert_close(sent - received, feedback.residual("g"), rtol=0, atol=1e-4)
    assert float(feedback.residual("g").norm()) < 2 * math.sqrt(64)


def test_ternary_is_much_closer_than_topk_at_the_same_bytes():
    # A GPT-2-like activation micro-batch: (B, T, C) = (4, 32, 64), ratio 0.05.
    tensor = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))
    ternary, topk = activation_codec(tensor.numel(), 0.05), TopKCodec(0.05)
    assert isinstance(ternary, TernaryCodec)

    def error(codec) -> float:
        decoded = unpack_tensor(pack_tensor(tensor, codec))
        return float((decoded - tensor).norm() / tensor.norm())

    assert error(ternary) < 0.5 < 0.8 < error(topk)


@pytest.mark.parametrize("numel", [1, 5, 100, 8192, 24_576, 10**7])
@pytest.mark.parametrize("ratio", [0.04, 0.05, 0.1, 0.25])
def test_activation_codec_fits_the_topk_budget(numel, ratio):
    codec = activation_codec(numel, ratio)
    budget = topk_wire_bytes(numel, ratio)
    if isinstance(codec, TernaryCodec):
        assert ternary_wire_bytes(numel, codec.group) <= budget
        # The smallest group that fits: one element less per group would not.
        if codec.group > 1:
            assert ternary_wire_bytes(numel, codec.group - 1) > budget
    else:
        assert isinstance(codec, TopKCodec)


def test_real_frames_fit_the_budget():
    tensor = torch.randn(4 * 32 * 64)
    data = pack_tensor(tensor, activation_codec(tensor.numel(), 0.05))
    frame = _frame(data)
    assert frame["c"] == "tern"
    assert frame["g"] == 81
    assert len(frame["s"]) + len(frame["t"]) <= topk_wire_bytes(tensor.numel(), 0.05)


def test_codec_choice_by_ratio():
    numel = 8192
    assert isinstance(activation_codec(numel, 1.0), IdentityCodec)
    assert isinstance(activation_codec(numel, 0.05), TernaryCodec)
    # Too few bytes for 1.6 bits per element, or so many that top-k keeps most of the energy.
    assert isinstance(activation_codec(numel, 0.02), TopKCodec)
    assert isinstance(activation_codec(numel, 0.5), TopKCodec)
    assert isinstance(budget_codec(numel, 0.05, ternary=False), TopKCodec)
    assert ternary_group_for(numel, 0.02) is None
    assert ternary_group_for(0, 0.05) == 1


def test_adatopk_gives_activation_links_the_ternary_code():
    # 1 MB/s for 0.1 s against 1.6 MB dense: a wire fraction of 1/16, top-k at 0.0625.
    args = (1e6, 1.6e6, 0.1)
    gradients = AdaTopK(AdaTopKConfig()).codec_for(*args)
    activations = AdaTopK(AdaTopKConfig(ternary=True)).codec_for(*args)
    assert isinstance(gradients, TopKCodec)
    assert isinstance(activations, TernaryCodec)
    assert ternary_wire_bytes(400_000, activations.group) <= topk_wire_bytes(
        400_000, gradients.ratio
    )


def test_large_scales_travel_as_bfloat16():
    tensor = torch.tensor([1e6, -1e6, 0.0, 2e6])
    frame = _frame(pack_tensor(tensor, TernaryCodec(4)))
    assert frame["wd"] == "bfloat16"
    decoded = unpack_tensor(pack_tensor(tensor, TernaryCodec(4)))
    assert bool(torch.isfinite(decoded).all())


def test_all_zero_groups_decode_to_zero():
    tensor = torch.zeros(2, 10)
    tensor[1, 3] = 1.0
    decoded = unpack_tensor(pack_tensor(tensor, TernaryCodec(10)))
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize("group", [0, -3, 1.5, True])
def test_bad_group_is_refused_on_construction(group):
    with pytest.raises(ValueError, match="group"):
        TernaryCodec(group)


def test_encode_refuses_non_finite_and_integer_input():
    with pytest.raises(ValueError, match="non-finite"):
        pack_tensor(torch.tensor([1.0, float("nan")]), TernaryCodec(2))
    with pytest.raises(ValueError, match="float"):
        pack_tensor(torch.arange(4), TernaryCodec(2))


def test_adatopk_config_still_validates():
    with pytest.raises(ConfigError):
        AdaTopKConfig(ternary=True, min_ratio=0.0)


# --- refusals -------------------------------------------------------------------------------


def _good_frame() -> dict:
    # 23 elements: 5 bytes of symbols, the last holding 3 digits; groups of 8: 3 scales.
    frame = _frame(pack_tensor(torch.randn(23), TernaryCodec(8)))
    assert len(frame["t"]) == 5
    assert len(frame["s"]) == 3 * 2
    return frame


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.update(extra=1), "keys"),
        (lambda f: f.pop("s"), "keys"),
        (lambda f: f.update(wd="float32"), "dtype"),
        (lambda f: f.update(g=0), "group"),
        (lambda f: f.update(g=24), "group"),
        (lambda f: f.update(g=2**62), "group"),
        (lambda f: f.update(g=True), "group"),
        (lambda f: f.update(g=8.0), "group"),
        (lambda f: f.update(g=4), "scales"),  # 6 groups need 12 bytes of scales
        (lambda f: f.update(s=b"\x00" * 5), "scales"),
        (lambda f: f.update(s="abc"), "bytes"),
        (lambda f: f.update(t=b"\x00" * 4), "symbols"),
        (lambda f: f.update(t=b"\x00" * 6), "symbols"),
        (lambda f: f.update(t=b"\xf3" + b"\x00" * 4), "242"),
        (lambda f: f.update(t=b"\x00" * 4 + b"\x1b"), "past the end"),  # 27 = digit 3 set
        (lambda f: f.update(sh=[26]), "scales"),  # 4 groups of 8 now
    ],
)
def test_malformed_frames_are_refused(mutate, message):
    frame = _good_frame()
    mutate(frame)
    with pytest.raises(FrameError, match=message):
        unpack_tensor(_repack(frame))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_scales_are_refused(bad):
    frame = _good_frame()
    scales = torch.frombuffer(bytearray(frame["s"]), dtype=torch.float16).clone()
    scales[1] = bad
    frame["s"] = scales.numpy().tobytes()
    with pytest.raises(FrameError, match=r"NaN|>= 0"):
        unpack_tensor(_repack(frame))


def test_non_float_target_is_refused():
    frame = _good_frame()
    frame["dt"] = "int32"
    with pytest.raises(FrameError, match="cannot decode"):
        unpack_tensor(_repack(frame))


def test_truncated_frames_are_refused():
    data = pack_tensor(torch.randn(100), TernaryCodec(10))
    for cut in range(len(data)):
        with pytest.raises(FrameError):
            unpack_tensor(data[:cut])


def test_decode_respects_the_element_limit():
    data = pack_tensor(torch.randn(100), TernaryCodec(10))
    with pytest.raises(FrameError, match="exceeds"):
        unpack_tensor(data, limits=FrameLimits(max_elements=50))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64), key=st.sampled_from(["s", "t", "g", "wd"]))
def test_random_fields_decode_or_raise_frame_error(data, key):
    frame = _good_frame()
    frame[key] = data if key in ("s", "t") else int.from_bytes(data[:2] or b"\x00", "little")
    if key == "wd":
        frame[key] = data.decode("latin-1")[:8]
    try:
        out = unpack_tensor(_repack(frame))
    except FrameError:
        return
    assert out.shape == (23,)
    assert bool(torch.isfinite(out).all())


def test_damaged_frames_decode_or_raise_frame_error():
    rng = random.Random(5)
    seeds = [pack_tensor(torch.randn(n), TernaryCodec(g)) for n, g in [(23, 8), (300, 81), (1, 1)]]
    for _ in range(3000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            out = unpack_tensor(bytes(raw), limits=FrameLimits(max_elements=1 << 16))
        except FrameError:
            continue
        assert bool(torch.isfinite(out).all())
