"""The fast exact top-k selection against torch.topk, including the paths it rarely takes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.compression import select_topk, topk_count
from fusionllm.compression.topk import (
    bitmap_popcount,
    bitmap_to_mask,
    indices_to_bitmap,
    pack_bits_torch,
    unpack_bits_torch,
)


def _assert_exact_topk(flat: torch.Tensor, k: int) -> None:
    chosen = select_topk(flat, k)
    assert chosen.dtype == torch.int64
    assert chosen.numel() == k
    assert bool((chosen[1:] > chosen[:-1]).all()), "indices must be strictly ascending"
    reference = torch.topk(flat.abs().float(), k).values
    got = torch.sort(flat[chosen].abs().float(), descending=True).values
    assert torch.equal(got, reference)


@pytest.mark.parametrize("ratio", [0.0001, 0.001, 0.01, 0.1, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_tensors_match_torch_topk(ratio, dtype):
    generator = torch.Generator().manual_seed(3)
    flat = torch.randn(300_000, generator=generator).to(dtype)
    _assert_exact_topk(flat, topk_count(flat.numel(), ratio))


@pytest.mark.parametrize(
    "make",
    [
        lambda n: torch.ones(n),  # every magnitude ties
        lambda n: torch.where(torch.arange(n) % 50 == 0, torch.randn(n), torch.zeros(n)),
        lambda n: torch.randn(n).round(),  # few distinct values
        lambda n: torch.cat([torch.randn(n // 2) * 1e-30, torch.randn(n - n // 2) * 1e30]),
        lambda n: torch.linspace(-1, 1, n),  # sorted: sampling must not assume shuffled data
    ],
    ids=["all-equal", "sparse", "rounded", "huge-range", "sorted"],
)
@pytest.mark.parametrize("ratio", [0.001, 0.05])
def test_adversarial_value_distributions(make, ratio):
    torch.manual_seed(5)
    flat = make(200_000)
    _assert_exact_topk(flat, topk_count(flat.numel(), ratio))


def test_nan_never_displaces_a_finite_value_unless_needed():
    flat = torch.randn(100_000)
    flat[::1000] = float("nan")
    chosen = select_topk(flat, 500)
    assert chosen.numel() == 500
    assert bool(torch.isfinite(flat[chosen]).all())


@settings(max_examples=50, deadline=None)
@given(numel=st.integers(0, 3000), ratio=st.floats(0.0001, 1.0), seed=st.integers(0, 1000))
def test_small_tensors_any_k(numel, ratio, seed):
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    k = topk_count(numel, ratio)
    assert k == (0 if numel == 0 else min(numel, max(1, -(-ratio * numel // 1))))
    _assert_exact_topk(flat, k)


def test_topk_count_rejects_bad_ratio():
    for ratio in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="ratio"):
            topk_count(10, ratio)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), numel=st.integers(1, 200))
def test_bitmap_round_trip(data, numel):
    marked = data.draw(st.sets(st.integers(0, numel - 1), max_size=numel))
    indices = torch.tensor(sorted(marked), dtype=torch.int64)
    bitmap = indices_to_bitmap(indices, numel)
    assert bitmap.numel() == (numel + 7) // 8
    assert bitmap_popcount(bitmap) == len(marked)
    mask = bitmap_to_mask(bitmap, numel)
    assert mask.dtype == torch.bool
    assert mask.shape == (numel,)
    assert torch.equal(torch.nonzero(mask).view(-1), indices)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), numel=st.integers(1, 100))
def test_torch_bit_packing_matches_numpy(data, numel):
    # The torch versions serve CUDA tensors; on CPU they must agree with numpy's bit for bit.
    marked = data.draw(st.sets(st.integers(0, numel - 1), max_size=numel))
    indices = torch.tensor(sorted(marked), dtype=torch.int64)
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[indices] = True
    bitmap = indices_to_bitmap(indices, numel)
    assert torch.equal(pack_bits_torch(mask), bitmap)
    assert torch.equal(unpack_bits_torch(bitmap, numel), mask)
