"""Sampling: greedy is argmax, seeded draws repeat, top-p keeps the nucleus, bad logits refused."""

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.node.serve.api import BadLogitsError, SamplingParams, next_token


def test_greedy_is_argmax_and_needs_no_generator():
    params = SamplingParams(max_new_tokens=4)
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert params.generator() is None
    assert next_token(logits, params, None, 4) == 1


def test_a_seed_repeats_its_draws_and_another_seed_differs():
    logits = torch.zeros(50)
    draws = []
    for seed in (7, 7, 8):
        params = SamplingParams(temperature=1.0, seed=seed)
        gen = params.generator()
        draws.append([next_token(logits, params, gen, 50) for _ in range(20)])
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_top_p_samples_only_inside_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    gen = params.generator()
    seen = {next_token(logits, params, gen, 4) for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    "logits",
    [torch.zeros(3), torch.zeros(4, dtype=torch.int64), torch.tensor([0.0, float("nan"), 1, 2])],
)
def test_logits_of_the_wrong_shape_dtype_or_not_finite_are_refused(logits):
    with pytest.raises(BadLogitsError):
        next_token(logits, SamplingParams(), None, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"temperature": float("inf")},
        {"top_p": 0.0},
        {"seed": -1},
        {"stop_ids": (-3,)},
    ],
)
def test_out_of_range_params_are_refused(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)
