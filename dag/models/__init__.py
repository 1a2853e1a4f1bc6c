"""Models written to trace cleanly with torch.fx; random init, nothing is downloaded.

- gpt2.py:   ``gpt2(name)``: GPT-2 tiny/small/medium/large/xl, Hugging Face GPT2LMHeadModel names
- resnet.py: ``resnet(depth)``: ResNet-18/34/50/101/152, torchvision names
"""

from fusionllm.dag.models.gpt2 import GPT2, GPT2Config, gpt2, load_hf_state_dict
from fusionllm.dag.models.resnet import ResNet, ResNetConfig, resnet

__all__ = [
    "GPT2",
    "GPT2Config",
    "ResNet",
    "ResNetConfig",
    "gpt2",
    "load_hf_state_dict",
    "resnet",
]
