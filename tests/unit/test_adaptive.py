"""The AdaTopK policy: the pure rule and the per-link state with hysteresis."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.compression import (
    AdaTopK,
    AdaTopKConfig,
    Float16Codec,
    IdentityCodec,
    TopKCodec,
    target_ratio,
    topk_wire_bytes,
)

MB = 1e6


def test_fast_link_sends_dense():
    assert target_ratio(1e9, 10 * MB, 0.1) == 1.0


def test_link_that_fits_half_the_bytes_sends_fp16_not_topk():
    assert target_ratio(60 * MB, 10 * MB, 0.1) == 1.0
    assert target_ratio(60 * MB, 10 * MB, 0.1, allow_fp16=False) < 1.0


@given(
    bandwidth=st.floats(1e5, 1e10),
    dense_mb=st.floats(0.1, 1000),
    budget=st.floats(1e-3, 10),
)
def test_topk_ratio_fits_the_budget_or_sits_at_the_floor(bandwidth, dense_mb, budget):
    dense = dense_mb * MB
    ratio = target_ratio(bandwidth, dense, budget, min_ratio=1e-4, allow_fp16=False)
    assert 1e-4 <= ratio <= 1.0
    if ratio < 1.0:
        numel = int(dense / 4)
        wire = topk_wire_bytes(numel, ratio)
        if ratio > 1e-4:
            # k is rounded up to a whole element: allow that one element's bytes.
            assert wire <= bandwidth * budget * 1.001 + 6
        if 1e-4 < ratio < 0.99:
            # and it is the largest that fits: 5% more would not.
            assert topk_wire_bytes(numel, min(1.0, ratio * 1.05)) > bandwidth * budget * 0.999


def test_ratio_is_bounded_below():
    assert target_ratio(1.0, 1e9, 1e-3, min_ratio=0.01) == 0.01


def test_bad_inputs_are_refused():
    for args in [(-1, 1, 1), (1, float("nan"), 1), (1, 1, float("inf"))]:
        with pytest.raises(ValueError, match="finite"):
            target_ratio(*args)
    with pytest.raises(ConfigError):
        AdaTopKConfig(min_ratio=0)
    with pytest.raises(ConfigError):
        AdaTopKConfig(hysteresis=-1)


def test_noisy_bandwidth_does_not_make_the_ratio_flap():
    policy = AdaTopK()
    generator = torch.Generator().manual_seed(0)
    noise = 1 + 0.1 * (2 * torch.rand(500, generator=generator) - 1)  # ±10 %
    ratios = {policy.ratio_for(20 * MB * float(n), 100 * MB, 0.05) for n in noise}
    assert len(ratios) == 1
    assert next(iter(ratios)) < 0.1


def test_a_real_change_in_bandwidth_moves_the_ratio_both_ways():
    policy = AdaTopK()
    start = policy.ratio_for(20 * MB, 100 * MB, 0.05)
    slower = policy.ratio_for(5 * MB, 100 * MB, 0.05)
    assert slower < start / 2
    faster = policy.ratio_for(20 * MB, 100 * MB, 0.05)
    assert math.isclose(faster, start)


def test_ratio_never_overshoots_the_budget_by_more_than_the_band():
    policy = AdaTopK(AdaTopKConfig(hysteresis=0.25, min_ratio=1e-5))
    dense = 64 * MB
    for bandwidth in [10 * MB, 12 * MB, 9 * MB, 30 * MB, 3 * MB, 3.3 * MB]:
        ratio = policy.ratio_for(bandwidth, dense, 0.1)
        wire = topk_wire_bytes(int(dense / 4), ratio)
        assert wire <= bandwidth * 0.1 * 1.25 + 6


def test_codec_for_picks_the_most_faithful_codec_that_fits():
    assert AdaTopK().codec_for(1e9, 10 * MB, 0.1) == IdentityCodec()
    assert AdaTopK().codec_for(60 * MB, 10 * MB, 0.1) == Float16Codec(torch.float16)
    codec = AdaTopK().codec_for(1 * MB, 10 * MB, 0.1)
    assert isinstance(codec, TopKCodec)
    assert codec.ratio < 0.05
    no_fp16 = AdaTopK(AdaTopKConfig(allow_fp16=False)).codec_for(60 * MB, 10 * MB, 0.1)
    assert isinstance(no_fp16, TopKCodec)
    half_input = AdaTopK().codec_for(60 * MB, 10 * MB, 0.1, element_size=2)
    assert isinstance(half_input, TopKCodec)
