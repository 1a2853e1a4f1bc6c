"""Incremental decoding with a KV cache equals the training forward (fp32, 1e-5)."""

import asyncio

import pytest
import torch

from fusionllm.dag.models import gpt2, llama, save_pretrained
from fusionllm.dag.models.decoding import CachedSpan, Span, load_span
from fusionllm.dag.models.kv_cache import CacheFullError
from fusionllm.node.serve.api import SamplingParams
from fusionllm.node.serve.local import LocalSource, generate

torch.manual_seed(0)
MODELS = {
    "gpt2": lambda: gpt2("tiny", vocab_size=61, block_size=40),
    "llama-gqa": lambda: llama("llama-tiny", vocab_size=61),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(3)
    return MODELS[name]().eval()


def _ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 61, (1, length), generator=torch.Generator().manual_seed(seed))


def _whole(model) -> CachedSpan:
    layers = model.config.num_hidden_layers
    return CachedSpan(model, Span(start=0, stop=layers, layers=layers))


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("prefill", [1, 5, 17])
def test_prefill_then_one_at_a_time_equals_the_training_forward(name, prefill):
    model = _model(name)
    idx = _ids(24)
    with torch.no_grad():
        expected = model(idx)  # (1, 24, V)
    span = _whole(model)
    cache = span.new_cache(24)
    pieces = [span.forward(idx[:, :prefill], cache)]
    for t in range(prefill, 24, 3):  # several positions at once after a prefill, too
        pieces.append(span.forward(idx[:, t : t + 3], cache))
    got = torch.cat(pieces, dim=1)
    assert cache.length == 24
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_a_chain_of_spans_equals_the_whole_model(name):
    model = _model(name)
    idx = _ids(12)
    with torch.no_grad():
        expected = model(idx)[:, -1]  # (1, V)
    spans = [CachedSpan(model, Span(start=a, stop=b, layers=2)) for a, b in ((0, 1), (1, 2))]
    caches = [s.new_cache(13) for s in spans]
    x = idx[:, :11]
    for s, c in zip(spans, caches, strict=True):
        x = s.forward(x, c)
    x = idx[:, 11:]
    for s, c in zip(spans, caches, strict=True):
        x = s.forward(x, c)
    torch.testing.assert_close(x[:, -1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_a_span_loaded_from_a_folder_reads_only_its_blocks(tmp_path, name):
    model = _model(name)
    save_pretrained(model, tmp_path)
    last = load_span(tmp_path, 1)
    held = {n for n, p in last.model.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert held
    assert all(".0." not in n and "embed" not in n and "wpe" not in n for n in held)
    whole = _whole(model)
    hidden = torch.randn(1, 6, _width(model))  # (1, T, C)
    in_memory = CachedSpan(model, Span(start=1, stop=2, layers=2))
    torch.testing.assert_close(
        last.forward(hidden, last.new_cache(6)),
        in_memory.forward(hidden, in_memory.new_cache(6)),
        atol=0,
        rtol=0,
    )
    assert whole.span.heads
    assert last.span.heads
    assert not last.span.embeds


def _width(model) -> int:
    c = model.config
    return getattr(c, "n_embd", None) or c.hidden_size


def test_a_cache_refuses_positions_past_its_length():
    model = _model("gpt2")
    span = _whole(model)
    cache = span.new_cache(4)
    span.forward(_ids(3), cache)
    with pytest.raises(CacheFullError, match="2 new positions after 3"):
        span.forward(_ids(2), cache)
    assert cache.nbytes == 2 * 2 * 2 * 4 * 32 * 4  # k and v, 2 layers, 2 heads x 32, 4 positions


def test_span_bounds_are_checked():
    with pytest.raises(ValueError, match="0 <= start < stop <= 2"):
        Span(start=1, stop=3, layers=2)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_local_greedy_equals_argmax_of_the_one_process_model(name):
    model = _model(name)
    prompt = _ids(5)[0].tolist()
    got = asyncio.run(generate(LocalSource(model), prompt, SamplingParams(max_new_tokens=8)))
    idx = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got == idx[0, 5:].tolist()


def test_local_sampling_with_a_seed_repeats():
    source = LocalSource(_model("llama-gqa"))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=7)
    first = asyncio.run(generate(source, [1, 2, 3], params))
    assert first == asyncio.run(generate(source, [1, 2, 3], params))
    assert all(0 <= t < 61 for t in first)
