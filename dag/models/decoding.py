"""Incremental decoding: a contiguous range of a model's decoder blocks run with a KV cache.

Serving cuts a model into spans of whole blocks (as Petals does), not into the training
plan's fx cuts: between spans only the residual stream (1, T, C) travels, and a block's
past keys and values stay where the block is. The first span also embeds the ids, the last
also applies the final norm and the head. A span runs the model's own submodules (its
weights, whatever wraps its projections), recomputing only attention around a cache, so a
prefill then token-by-token decode equals the training forward (unit tests: fp32, 1e-5).
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional

from fusionllm.common.errors import ConfigError
from fusionllm.dag.models import registry
from fusionllm.dag.models.gpt2 import GPT2
from fusionllm.dag.models.kv_cache import CacheShape, KVCache
from fusionllm.dag.models.llama import Llama
from fusionllm.dag.models.materialise import FolderWeights, canonical_names, materialise
from fusionllm.dag.models.pretrained import check_layers, read_config


@dataclass(frozen=True, kw_only=True)
class Span:
    """Blocks [start, stop) of a model with ``layers`` blocks."""

    start: int
    stop: int
    layers: int

    def __post_init__(self) -> None:
        if not (
            all(isinstance(x, int) for x in (self.start, self.stop, self.layers))
            and 0 <= self.start < self.stop <= self.layers
        ):
            raise ConfigError(
                f"a span must be blocks 0 <= start < stop <= {self.layers}, got "
                f"[{self.start}, {self.stop})"
            )

    @property
    def embeds(self) -> bool:
        return self.start == 0

    @property
    def heads(self) -> bool:
        return self.stop == self.layers


def model_parts(model: nn.Module, span: Span) -> dict[str, nn.Module]:
    """The submodules ``span`` runs, by their names in the model (embeddings, blocks, head)."""
    if isinstance(model, GPT2):
        names = ["transformer.wte", "transformer.wpe"] if span.embeds else []
        names += [f"transformer.h.{i}" for i in range(span.start, span.stop)]
        names += ["transformer.ln_f", "lm_head"] if span.heads else []
    elif isinstance(model, Llama):
        names = ["model.embed_tokens"] if span.embeds else []
        names += [f"model.layers.{i}" for i in range(span.start, span.stop)]
        names += ["model.norm", "lm_head"] if span.heads else []
    else:
        raise ConfigError(f"no incremental decoding for {type(model).__name__}")
    return {name: model.get_submodule(name) for name in names}


def causal_mask(past: int, new: int, device: torch.device) -> torch.Tensor | None:
    """Where new query i (position past + i) may look among past + new keys: None when
    every key is allowed (one new position), else (new, past + new) bool."""
    if new == 1:
        return None
    keys = torch.arange(past + new, device=device)  # (past + new,)
    queries = torch.arange(past, past + new, device=device)  # (new,)
    return keys[None, :] <= queries[:, None]


def attend(q, k, v, past: int, *, gqa: bool = False) -> torch.Tensor:
    """Causal attention of new queries q (1, nh, T, hd) over cached k, v (1, nkv, past+T, hd)."""
    if past == 0:  # the training forward's own call, so a prefill is the same computation
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = causal_mask(past, q.shape[-2], q.device)
    return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class CachedSpan:
    """Runs ``span`` of ``model`` (whose parts in the span are real; others may be on meta).

    ``forward(x, cache)``: x is ids (1, T) int64 on the first span, else the residual stream
    (1, T, C); returns the stream (1, T, C), or logits (1, T, V) on the last span."""

    def __init__(self, model: nn.Module, span: Span) -> None:
        self.model = model
        self.span = span
        self.parts = model_parts(model, span)  # checks the architecture
        self.config = model.config

    def cache_shape(self, max_len: int) -> CacheShape:
        c = self.config
        if isinstance(self.model, GPT2):
            kv_heads, head_dim = c.n_head, c.head_dim
        else:
            kv_heads, head_dim = c.num_key_value_heads, c.head_dim
        layers = self.span.stop - self.span.start
        return CacheShape(layers=layers, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len)

    def new_cache(self, max_len: int, *, dtype=torch.float32, device="cpu") -> KVCache:
        return KVCache(self.cache_shape(max_len), dtype=dtype, device=device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        new = x.shape[1]
        cache.check_room(new)
        past = cache.length
        if self.span.embeds:
            x = self._embed(x, past)  # (1, T, C)
        gpt2 = isinstance(self.model, GPT2)
        for layer in range(self.span.stop - self.span.start):
            block = self.parts[self._block_name(self.span.start + layer)]
            run = _gpt2_block if gpt2 else _llama_block
            x = run(block, x, cache, layer, past)
        cache.advance(new)
        if self.span.heads:
            norm = "transformer.ln_f" if gpt2 else "model.norm"
            x = self.parts["lm_head"](self.parts[norm](x))  # (1, T, V)
        return x

    def _block_name(self, i: int) -> str:
        return f"transformer.h.{i}" if isinstance(self.model, GPT2) else f"model.layers.{i}"

    def _embed(self, idx: torch.Tensor, past: int) -> torch.Tensor:
        if isinstance(self.model, GPT2):
            positions = torch.arange(past, past + idx.shape[1], device=idx.device)  # (T,)
            return self.parts["transformer.wte"](idx) + self.parts["transformer.wpe"](positions)
        return self.parts["model.embed_tokens"](idx)


def _gpt2_block(block, x: torch.Tensor, cache: KVCache, layer: int, past: int) -> torch.Tensor:
    attn = block.attn
    qkv = attn.c_attn(block.ln_1(x))  # (1, T, 3C)
    c = attn.n_embd
    q, k, v = (
        t.unflatten(-1, (attn.n_head, attn.head_dim)).transpose(1, 2)  # (1, nh, T, hs)
        for t in (qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :])
    )
    keys, values = cache.append(layer, k, v)  # (1, nh, past + T, hs)
    y = attend(q, keys, values, past).transpose(1, 2).flatten(-2)  # (1, T, C)
    x = x + attn.c_proj(y)
    return x + block.mlp(block.ln_2(x))


def _llama_block(block, x: torch.Tensor, cache: KVCache, layer: int, past: int) -> torch.Tensor:
    attn = block.self_attn
    h = block.input_layernorm(x)  # (1, T, C)
    q = attn.q_proj(h).unflatten(-1, (attn.n_head, attn.head_dim)).transpose(1, 2)
    k = attn.k_proj(h).unflatten(-1, (attn.n_kv_head, attn.head_dim)).transpose(1, 2)
    v = attn.v_proj(h).unflatten(-1, (attn.n_kv_head, attn.head_dim)).transpose(1, 2)
    q, k = attn.rotary.at(q, past), attn.rotary.at(k, past)
    keys, values = cache.append(layer, k, v)  # (1, nkv, past + T, hd)
    y = attend(q, keys, values, past, gqa=attn.n_kv_head != attn.n_head)  # (1, nh, T, hd)
    x = x + attn.o_proj(y.transpose(1, 2).flatten(-2))
    return x + block.mlp(block.post_attention_layernorm(x))


def load_span(folder, start: int, stop: int | None = None) -> CachedSpan:
    """Blocks [start, stop) of a Hugging Face folder's model (stop None: to the last), only
    their tensors read: the rest of the model stays on the meta device."""
    config = read_config(folder)
    check_layers(Path(folder), config)
    with torch.device("meta"):
        model = registry.build(config)
    layers = config.num_hidden_layers
    span = Span(start=start, stop=layers if stop is None else stop, layers=layers)
    canonical = canonical_names(model)
    holder = nn.Module()  # the span's parts under names without dots, so one read fetches all
    names: dict[str, str] = {}
    for i, (prefix, part) in enumerate(model_parts(model, span).items()):
        holder.add_module(f"part{i}", part)
        for local, _ in part.named_parameters(remove_duplicate=False):
            names[f"part{i}.{local}"] = canonical[f"{prefix}.{local}"]
    materialise(holder, FolderWeights(folder, config), names)
    model.eval()
    return CachedSpan(model, span)
