"""Tiny random Hugging Face models made by transformers itself (a test-only dependency).

The references the loaders are checked against: nothing here is written by hand, nothing is
downloaded. Every parameter is perturbed after transformers' init, so norms are not all ones
and biases not all zeros (a loader that skipped them would still pass otherwise).
"""

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()

VOCAB = 96


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied weight is listed once
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


def hf_gpt2(*, tied: bool = True, seed: int = 0) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=48,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return _perturbed(GPT2LMHeadModel(config), seed)


def hf_llama(
    *,
    tied: bool = False,
    kv_heads: int = 2,
    rope: dict | None = None,
    bias: bool = False,
    seed: int = 0,
    vocab: int = VOCAB,
) -> LlamaForCausalLM:
    """4 query heads; ``kv_heads`` 4 is plain multi-head attention, 2 or 1 grouped-query."""
    config = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        hidden_size=32,
        intermediate_size=56,
        vocab_size=vocab,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return _perturbed(LlamaForCausalLM(config), seed)


def token_ids(batch: int = 2, length: int = 40, *, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits  # (B, T, V)
