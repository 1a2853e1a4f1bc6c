"""Round trips and refusals of the wire frame."""

import math
import re

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.compression import (
    FRAME_VERSION,
    Float16Codec,
    FrameError,
    FrameLimits,
    IdentityCodec,
    TopKCodec,
    pack_tensor,
    unpack_tensor,
)
from fusionllm.compression import codecs as codecs_module
from fusionllm.compression import frame as frame_module

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=4).map(tuple)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _frame(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def _repack(frame: dict) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(FLOAT_DTYPES), seed=st.integers(0, 2**16))
def test_identity_round_trip_is_exact(shape, dtype, seed):
    tensor = _tensor(shape, dtype, seed)
    decoded = unpack_tensor(pack_tensor(tensor))
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.int64).view(3, 4),
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int32),
        torch.zeros(0, 5, dtype=torch.uint8),
        torch.randn(3, 2, dtype=torch.float64),
    ],
    ids=["int64", "bool", "int32-0d", "uint8-empty", "float64"],
)
def test_identity_carries_non_float_dtypes(tensor):
    decoded = unpack_tensor(pack_tensor(tensor))
    assert decoded.dtype == tensor.dtype
    assert torch.equal(decoded, tensor)


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(FLOAT_DTYPES),
    wire=st.sampled_from([torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_float16_round_trip_within_wire_precision(shape, dtype, wire, seed):
    tensor = _tensor(shape, dtype, seed)
    decoded = unpack_tensor(pack_tensor(tensor, Float16Codec(wire)))
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    expected = tensor.to(wire).to(dtype)
    assert torch.equal(decoded, expected)


@settings(max_examples=80, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(FLOAT_DTYPES),
    ratio=st.sampled_from([0.001, 0.05, 0.3, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_topk_round_trip_keeps_exactly_k_largest(shape, dtype, ratio, seed):
    tensor = _tensor(shape, dtype, seed)
    decoded = unpack_tensor(pack_tensor(tensor, TopKCodec(ratio)))
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    numel = tensor.numel()
    k = min(numel, max(1, math.ceil(ratio * numel))) if numel else 0
    flat, flat_decoded = tensor.reshape(-1).float(), decoded.reshape(-1).float()
    kept = flat_decoded != 0
    # Entries that are exactly 0 cannot be told apart from dropped ones, so count at most k.
    assert int(kept.sum()) <= k
    if k:
        reference = torch.topk(flat.abs(), k).values
        kept_magnitudes = torch.sort(flat.abs()[torch.topk(flat_decoded.abs(), k).indices]).values
        assert torch.equal(kept_magnitudes, torch.sort(reference).values)
        wire = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        assert torch.equal(flat_decoded[kept], flat[kept].to(wire).float())


@pytest.mark.parametrize("ratio", [0.01, 0.2])
def test_topk_uses_the_smaller_index_format(ratio):
    tensor = torch.randn(10_000)
    frame = _frame(pack_tensor(tensor, TopKCodec(ratio)))
    k = math.ceil(ratio * 10_000)
    if 4 * k <= 10_000 // 8:
        assert frame["ix"] == "i32"
        assert len(frame["ixp"]) == 4 * k
    else:
        assert frame["ix"] == "bm"
        assert len(frame["ixp"]) == 10_000 // 8


def test_topk_switches_to_bfloat16_for_values_beyond_float16_range():
    tensor = torch.tensor([1e6, -3.0, 2.0, 0.5])
    frame = _frame(pack_tensor(tensor, TopKCodec(0.5)))
    assert frame["wd"] == "bfloat16"
    decoded = unpack_tensor(pack_tensor(tensor, TopKCodec(0.5)))
    assert math.isclose(float(decoded[0]), 1e6, rel_tol=1e-2)


@pytest.mark.parametrize("peak", [1e6, 3e30, 1e-9])
def test_float16_scales_magnitudes_beyond_its_range_and_keeps_its_precision(peak):
    """Loss-scaled gradients reach far past float16's ±65504 (and tiny ones below its
    subnormals): a power-of-two scale per frame brings them back, float16's 11 bits of
    precision intact (bfloat16 would keep 8)."""
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * peak
    data = pack_tensor(tensor, Float16Codec(torch.float16))
    frame = _frame(data)
    assert frame["wd"] == "float16"
    assert frame["e"] != 0
    assert len(frame["p"]) == 2 * tensor.numel()
    decoded = unpack_tensor(data)
    assert bool(torch.isfinite(decoded).all())
    relative = ((decoded - tensor).abs() / tensor.abs()).max()
    assert float(relative) <= 2.0**-11  # float16's rounding; bfloat16's would be 2**-8
    bf16 = (tensor.to(torch.bfloat16).float() - tensor).abs() / tensor.abs()
    assert float(bf16.max()) > 2.0**-11


def test_float16_falls_back_to_bfloat16_for_a_frame_beyond_every_scale():
    tensor = torch.tensor([1e300, 1.0], dtype=torch.float64)  # past float32's range
    with pytest.raises(ValueError, match="bfloat16"):
        pack_tensor(tensor, Float16Codec(torch.float16))
    wide = torch.tensor([3e38, 1.0, -2.0])
    fields = Float16Codec(torch.float16).encode(wide)
    assert fields["wd"] == "float16"
    assert fields["e"] < 0
    with pytest.raises(ValueError, match="not finite"):
        pack_tensor(torch.tensor([float("inf"), 1.0]), Float16Codec(torch.float16))


@pytest.mark.parametrize("exponent", [127, -127, 1.5, True, None, "3"])
def test_float16_refuses_a_peers_scale_outside_its_bounds(exponent):
    frame = _frame(pack_tensor(torch.ones(8), Float16Codec(torch.float16)))
    frame["e"] = exponent
    with pytest.raises(FrameError, match="exponent"):
        unpack_tensor(msgpack.packb(frame, use_bin_type=True))


def test_float16_refuses_a_peers_scale_that_overflows_the_tensor():
    frame = _frame(pack_tensor(torch.full((8,), 60000.0), Float16Codec(torch.float16)))
    frame["e"] = -120  # 2**120 x ~2**15 is past float32's range
    with pytest.raises(FrameError, match="NaN or infinite"):
        unpack_tensor(msgpack.packb(frame, use_bin_type=True))


def test_lossy_codecs_refuse_integer_tensors():
    with pytest.raises(ValueError, match="float"):
        pack_tensor(torch.arange(4), TopKCodec(0.5))


def test_non_contiguous_and_grad_tensors_are_packed_by_value():
    base = torch.randn(4, 6, requires_grad=True)
    view = base.t()[1:3]
    assert torch.equal(unpack_tensor(pack_tensor(view)), view.detach())


def test_frame_overhead_is_a_small_constant():
    tensor = torch.randn(1 << 18)  # 1 MiB
    data = pack_tensor(tensor)
    assert len(data) - tensor.numel() * 4 < 64


# --- refusals -------------------------------------------------------------------------------


def _good_topk_frame() -> dict:
    frame = _frame(pack_tensor(torch.randn(20, 20), TopKCodec(0.02)))  # k = 8, int32 indices
    assert frame["ix"] == "i32"
    return frame


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: f.update(v=FRAME_VERSION + 1), "version"),
        (lambda f: f.update(v=True), "version"),
        (lambda f: f.update(c="zstd"), "unknown codec"),
        (lambda f: f.update(dt="complex64"), "dtype"),
        (lambda f: f.update(sh=[6, -5]), "non-negative"),
        (lambda f: f.update(sh=[6, 5.0]), "non-negative"),
        (lambda f: f.update(sh=[1] * 9), "max_array_len"),
        (lambda f: f.update(sh=[10**6, 10**6]), "exceeds"),
        (lambda f: f.update(sh=[2, 2]), "outside"),
        (lambda f: f.update(k=7), "bytes"),
        (lambda f: f.update(k=-1), "outside"),
        (lambda f: f.update(k=401), "outside"),
        (lambda f: f.update(ix="csr"), "index format"),
        (lambda f: f.update(wd="float32"), "dtype"),
        (lambda f: f.update(p=b"\x00" * 11), "bytes"),
        (lambda f: f.update(ixp=b"\x00" * 32), "not strictly increasing"),
        (lambda f: f.update(extra=1), "keys"),
        (lambda f: f.pop("ixp"), "keys"),
    ],
)
def test_malformed_topk_frames_are_refused(mutate, message):
    frame = _good_topk_frame()
    mutate(frame)
    with pytest.raises(FrameError, match=message):
        unpack_tensor(_repack(frame))


def test_out_of_range_and_duplicate_indices_are_refused():
    frame = _good_topk_frame()
    indices = torch.frombuffer(bytearray(frame["ixp"]), dtype=torch.int32).clone()
    out_of_range = indices.clone()
    out_of_range[-1] = 400
    with pytest.raises(FrameError, match="outside"):
        unpack_tensor(_repack({**frame, "ixp": out_of_range.numpy().tobytes()}))
    duplicated = indices.clone()
    duplicated[1] = duplicated[0]
    with pytest.raises(FrameError, match="increasing"):
        unpack_tensor(_repack({**frame, "ixp": duplicated.numpy().tobytes()}))


def test_bitmap_with_wrong_count_or_stray_bits_is_refused():
    # 19 of 21 kept: positions 0..18, the largest magnitudes.
    frame = _frame(pack_tensor(torch.arange(21.0, 0.0, -1.0), TopKCodec(0.9)))
    assert frame["ix"] == "bm"
    bitmap = bytearray(frame["ixp"])
    stray = bytearray(bitmap)
    stray[-1] |= 0x80  # bit 23 of a 21-element tensor
    with pytest.raises(FrameError):
        unpack_tensor(_repack({**frame, "ixp": bytes(stray)}))
    missing = bytearray(bitmap)
    missing[0] &= 0xFE
    with pytest.raises(FrameError, match="marks"):
        unpack_tensor(_repack({**frame, "ixp": bytes(missing)}))


def test_truncated_frames_are_refused():
    data = pack_tensor(torch.randn(100), TopKCodec(0.1))
    for cut in range(len(data)):
        with pytest.raises(FrameError):
            unpack_tensor(data[:cut])


@pytest.mark.parametrize("codec", [IdentityCodec(), Float16Codec(), TopKCodec(0.5)])
def test_non_finite_values_are_refused_unless_allowed(codec):
    frame = _frame(pack_tensor(torch.ones(4), codec))
    wire = torch.float16 if codec.codec_id != "id" else torch.float32
    nans = torch.full((len(frame["p"]) // wire.itemsize,), float("nan"), dtype=wire)
    frame["p"] = nans.numpy().tobytes()
    with pytest.raises(FrameError, match="NaN"):
        unpack_tensor(_repack(frame))
    decoded = unpack_tensor(_repack(frame), limits=FrameLimits(allow_nonfinite=True))
    assert bool(decoded.isnan().any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 123_457, (1 << 20) - 1])
def test_one_non_finite_value_anywhere_in_a_large_tensor_is_refused(bad, position):
    tensor = torch.randn(1 << 20)
    tensor[position] = bad
    with pytest.raises(FrameError, match="NaN"):
        unpack_tensor(pack_tensor(tensor))


def test_bool_payload_must_be_zero_or_one():
    frame = _frame(pack_tensor(torch.tensor([True, False])))
    frame["p"] = b"\x01\x02"
    with pytest.raises(FrameError, match="bool"):
        unpack_tensor(_repack(frame))


def test_receiver_dtype_whitelist_applies():
    data = pack_tensor(torch.arange(3))
    with pytest.raises(FrameError, match="int64"):
        unpack_tensor(data, limits=FrameLimits(allowed_dtypes=frozenset({"float32"})))


def test_frame_over_the_size_limit_is_refused_before_parsing():
    data = pack_tensor(torch.randn(64))
    with pytest.raises(FrameError, match="exceeds"):
        unpack_tensor(data, limits=FrameLimits(max_frame_bytes=128))


def test_non_bytes_input_is_refused():
    with pytest.raises(FrameError):
        unpack_tensor("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "claim",
    [
        {"v": 1, "c": "id", "dt": "float32", "sh": [10**12], "p": b""},
        {
            "v": 1,
            "c": "topk",
            "dt": "float32",
            "sh": [10**6, 10**6],
            "wd": "float16",
            "k": 0,
            "ix": "i32",
            "p": b"",
            "ixp": b"",
        },
    ],
    ids=["identity", "topk"],
)
def test_huge_claim_fails_before_any_allocation(monkeypatch, claim):
    def refuse(*args, **kwargs):
        raise AssertionError("decoder allocated before validating")

    for name in ("zeros", "empty"):
        monkeypatch.setattr(codecs_module.torch, name, refuse)
    data = _repack(claim)
    assert len(data) < 80
    with pytest.raises(FrameError, match="exceeds"):
        unpack_tensor(data)


def _seed_frames() -> list[bytes]:
    frames = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in [(), (0,), (5,), (3, 7)]:
            tensor = _tensor(shape, dtype, 3)
            for codec in (IdentityCodec(), Float16Codec(), TopKCodec(0.5)):
                frames.append(pack_tensor(tensor, codec))
    frames.append(pack_tensor(torch.arange(10)))
    frames.append(pack_tensor(torch.tensor([True, False])))
    frames.append(_repack({"v": 1, "c": "id", "dt": "uint8", "sh": [2], "p": b"ab", "x": None}))
    frames.append(_repack({"v": -1, "c": "id", "dt": "int8", "sh": [-1, 2**63], "p": True}))
    return frames


def _mutants(seed: int, count: int) -> list[bytes]:
    import random

    rng = random.Random(seed)
    seeds = _seed_frames()
    out = list(seeds)
    for _ in range(count):
        raw = bytearray(rng.choice(seeds))
        kind = rng.randrange(4)
        if kind == 0:  # a byte anywhere, most often in the small fields up front
            raw[min(rng.randrange(len(raw)), rng.randrange(48))] = rng.randrange(256)
        elif kind == 1:
            del raw[rng.randrange(len(raw)) :]
        elif kind == 2:
            raw.insert(rng.randrange(len(raw) + 1), rng.randrange(256))
        else:
            raw += bytes(rng.randrange(1, 4))
        out.append(bytes(raw))
    return out


def _plain(value):
    if isinstance(value, memoryview):
        return bytes(value)
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, dict) else value


def test_fast_parse_reads_exactly_what_msgpack_reads():
    """What the copy-free parser accepts, msgpack decodes to the same map; the rest falls back."""
    limits = FrameLimits(max_frame_bytes=1 << 16)
    accepted = 0
    for data in _mutants(seed=7, count=6000):
        fast = frame_module._scan(data, limits)
        if fast is None:
            continue
        accepted += 1
        assert _plain(fast) == frame_module._unpack(data, limits)
        assert all(v.readonly for v in fast.values() if isinstance(v, memoryview))
    assert accepted > 500  # the fast path is the common path, not a curiosity


def test_fast_parse_leaves_oddities_to_msgpack():
    limits = FrameLimits()
    for frame in (
        {"v": 1, "p": 1.5},  # floats
        {"v": 1, "sh": [[1]]},  # nested arrays
        {"v": 1, "s": "x" * 40},  # a str over the limit
        {b"v": 1},  # a bytes key
        [1, 2],  # not a map
    ):
        assert frame_module._scan(_repack(frame), limits) is None
    assert frame_module._scan(_repack({"v": 1}) + b"\x00", limits) is None  # trailing bytes


@pytest.mark.parametrize("seed", range(3))
def test_copy_free_dense_decode_matches_the_codecs_own(seed):
    """unpack_tensor's own identity/f16 decoder agrees with the codecs' decode, error for error."""
    limits = FrameLimits(max_frame_bytes=1 << 16)
    checked = 0
    for data in _mutants(seed=seed, count=3000):
        try:
            frame_module._parse(data, limits)  # version and map checks
            frame = frame_module._unpack(data, limits)  # bins as bytes, for the codecs
            codec = frame_module._codec_of(frame)
            target = frame_module._target_of(frame, limits, None)
            codec.check_keys(frame)
        except FrameError:
            continue
        if codec not in (IdentityCodec, Float16Codec):
            continue
        checked += 1
        try:
            expected = codec.decode(frame, target, limits)
        except FrameError as exc:
            with pytest.raises(FrameError, match=f"^{re.escape(str(exc))}$"):
                unpack_tensor(data, limits=limits)
        else:
            got = unpack_tensor(data, limits=limits)
            assert got.dtype == expected.dtype
            assert got.shape == expected.shape
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
            )
    assert checked > 40


@pytest.mark.parametrize("codec", [IdentityCodec(), Float16Codec(), TopKCodec(0.5)])
def test_decoded_tensor_owns_its_memory(codec):
    """The receiver reuses its buffer for the next frame: the tensor must not point into it."""
    tensor = torch.randn(1000)
    buffer = bytearray(pack_tensor(tensor, codec))
    out = unpack_tensor(memoryview(buffer))
    expected = out.clone()
    buffer[:] = bytes(len(buffer))
    assert torch.equal(out, expected)
    assert out.numel() == 1000
    assert out.dtype == torch.float32


# The attack of issue 12: a few bytes of top-k declaring 2**28 float32 elements (1 GiB),
# within FrameLimits' element cap, so only the receiver's expectation can stop it.
_EXPANDING_CLAIM = {
    "v": 1,
    "c": "topk",
    "dt": "float32",
    "sh": [2**28],
    "wd": "float16",
    "k": 0,
    "ix": "i32",
    "p": b"",
    "ixp": b"",
}


def _forbid_allocation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoder allocated before validating")

    for name in ("zeros", "empty"):
        monkeypatch.setattr(codecs_module.torch, name, refuse)


def test_an_expanding_frame_is_refused_by_the_expected_shape_before_allocation(monkeypatch):
    data = _repack(_EXPANDING_CLAIM)
    assert len(data) < 80
    parsed = frame_module.parse_frame(data)
    assert parsed.decoded_bytes == 4 * 2**28  # what decoding it would allocate, known up front
    _forbid_allocation(monkeypatch)
    with pytest.raises(AssertionError, match="allocated"):  # nothing else would stop it
        unpack_tensor(data)
    with pytest.raises(FrameError, match=r"declares shape \[268435456\], expected \[4\]"):
        unpack_tensor(data, expect_dtype=torch.float32, expect_shape=(4,))
    with pytest.raises(FrameError, match=r"declares torch\.float32, expected torch\.float64"):
        unpack_tensor(data, expect_dtype=torch.float64, expect_shape=(2**28,))


def test_a_frame_matching_the_expectation_decodes_as_before():
    tensor = _tensor((3, 5), torch.float32, 1)
    data = pack_tensor(tensor, TopKCodec(0.5))
    decoded = unpack_tensor(data, expect_dtype=torch.float32, expect_shape=(3, 5))
    assert torch.equal(decoded, unpack_tensor(data))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5, 7), (4096,), (1, 1, 1, 1, 9)])
def test_no_codec_writes_a_frame_longer_than_max_encoded_bytes(dtype, shape):
    from fusionllm.compression import TernaryCodec

    tensor = _tensor(shape, dtype, 5)
    bound = frame_module.max_encoded_bytes(dtype, shape)
    codecs = [None, Float16Codec(), Float16Codec(torch.bfloat16), TernaryCodec(1), TernaryCodec(64)]
    codecs += [TopKCodec(r) for r in (1.0, 0.5, 0.03, 0.001)]
    for codec in codecs:
        assert len(pack_tensor(tensor, codec)) <= bound, codec


def test_a_spec_with_a_negative_dim_allows_no_body():
    assert frame_module.max_encoded_bytes(torch.float32, (-1,)) == 0
