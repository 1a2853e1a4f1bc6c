"""Models written to trace cleanly with torch.fx; random init or Hugging Face folders.

- gpt2.py:        ``gpt2(name)``: GPT-2 tiny/small/medium/large/xl, GPT2LMHeadModel names
- llama.py:       ``llama(name)``: Llama-family decoders, llama-tiny/1b, LlamaForCausalLM names
- rope.py:        rotary settings and their inverse frequencies (default, linear, llama3)
- resnet.py:      ``resnet(depth)``: ResNet-18/34/50/101/152, torchvision names
- registry.py:    every architecture and preset; the one way a run builds its model
- pretrained.py:  ``from_pretrained(folder)`` / ``save_pretrained(model, folder)``
- materialise.py: a model on meta made real one parameter at a time (seeded per name, or
                  read by name from a folder), so a pipeline stage holds only its own
- hf_config.py:   config.json <-> our configs (transformers 4.x and 5.x forms)
- hf_tensors.py:  safetensors files read checked and written atomically
- hf_errors.py:   the typed errors a folder is refused with
"""

from fusionllm.dag.models.gpt2 import GPT2, GPT2Config, gpt2
from fusionllm.dag.models.llama import Llama, LlamaConfig, llama
from fusionllm.dag.models.pretrained import from_pretrained, read_config, save_pretrained
from fusionllm.dag.models.resnet import ResNet, ResNetConfig, resnet
from fusionllm.dag.models.rope import RopeConfig

__all__ = [
    "GPT2",
    "GPT2Config",
    "Llama",
    "LlamaConfig",
    "ResNet",
    "ResNetConfig",
    "RopeConfig",
    "from_pretrained",
    "gpt2",
    "llama",
    "read_config",
    "resnet",
    "save_pretrained",
]
