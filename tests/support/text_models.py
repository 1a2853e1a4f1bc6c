"""Model folders with text: a small random GPT-2 and the byte-level BPE tokenizer it reads.

Nothing is downloaded: the tokenizer is trained here on a few sentences (``bpe.train_bpe``)
and the weights are seeded random, so outputs are arbitrary but the same every run.
"""

import json
from pathlib import Path

import torch

from fusionllm.dag.models import registry
from fusionllm.dag.models.gpt2 import GPT2Config
from fusionllm.dag.models.pretrained import save_state
from tests.support.bpe import train_bpe

VOCAB = 320
EOS = "<|endoftext|>"  # id 0: train_bpe's one special token
TEXTS = [
    "The swarm serves text to anyone who asks, one token at a time. " * 8,
    "Grüße aus Köln: naïve café, 日本語のテキスト, emoji 🚀 and ☃ too. " * 8,
    "def generate(prompt):\n    return model(prompt)  # a tiny program\n" * 8,
]


def write_tokenizer(folder: Path, *, chat_template: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    train_bpe(TEXTS, VOCAB).save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))


def write_text_model(folder: Path, *, seed: int = 0, block_size: int = 96) -> Path:
    """A random 2-layer GPT-2 of VOCAB ids with its tokenizer.json; eos is id 0."""
    write_tokenizer(folder)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, block_size=block_size)
    torch.manual_seed(seed)
    model = registry.build(config)
    state = {name: torch.randn_like(t) * 0.5 for name, t in model.state_dict().items()}
    save_state(config, state, folder, like={"eos_token_id": 0, "bos_token_id": 0})
    return folder
