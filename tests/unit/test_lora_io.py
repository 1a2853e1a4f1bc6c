"""Adapters in PEFT's layout: PEFT (test-only) loads what we save onto transformers' model with
the same logits, our merge equals its merge_and_unload, and a tampered folder is refused."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from fusionllm.dag.models import from_pretrained
from fusionllm.dag.models.hf_errors import CheckpointFolderError, TensorShapeError
from fusionllm.dag.models.lora import LoraConfig, LoraLinear, adapter_state, add_adapters
from fusionllm.dag.models.lora_io import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_adapters,
    merged,
    save_adapters,
)
from tests.support.hf_models import hf_gpt2, hf_llama, hf_logits, token_ids

CASES = {
    "gpt2": (hf_gpt2, LoraConfig(rank=4, alpha=8.0)),
    "gpt2-attn": (hf_gpt2, LoraConfig(rank=2, alpha=3.0, targets=("c_attn",))),
    "llama": (lambda: hf_llama(kv_heads=2), LoraConfig(rank=4, alpha=16.0, fa=True)),
}


def _adapted(hf_model, lora: LoraConfig, tmp_path):
    """Our model of ``hf_model``'s folder with random (non-zero) adapters, and the folder."""
    hf_model.save_pretrained(tmp_path / "base")
    ours = from_pretrained(tmp_path / "base")
    add_adapters(ours, lora)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in ours.modules():
            if isinstance(module, LoraLinear):
                module.lora_A.copy_(torch.randn(module.lora_A.shape, generator=generator) * 0.1)
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * 0.1)
    return ours


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_our_adapters_onto_transformers_model_with_our_logits(case, tmp_path) -> None:
    make, lora = CASES[case]
    ours = _adapted(make(), lora, tmp_path)
    save_adapters(ours, lora, adapter_state(ours), tmp_path / "adapter", base="base")
    idx = token_ids()
    with torch.no_grad():
        expected = ours(idx)
    peft_model = PeftModel.from_pretrained(make(), tmp_path / "adapter").eval()
    torch.testing.assert_close(hf_logits(peft_model, idx), expected, rtol=1e-5, atol=1e-5)
    # And PEFT's merge is ours.
    ours_merged = merged(from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    reference = peft_model.merge_and_unload()
    state = ours_merged.state_dict()
    for name, tensor in reference.state_dict().items():
        if name in state:
            torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(ours_merged(idx), hf_logits(reference, idx), rtol=1e-5, atol=1e-5)


def test_saved_keys_and_config_are_pefts(tmp_path) -> None:
    make, lora = CASES["gpt2"]
    ours = _adapted(make(), lora, tmp_path)
    save_adapters(ours, lora, adapter_state(ours), tmp_path / "adapter")
    keys = set(load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in keys
    assert "base_model.model.transformer.h.1.mlp.c_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 2 * 4  # A and B, 2 blocks, 4 layers each
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["fan_in_fan_out"] is True
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["target_modules"] == ["c_attn", "c_fc", "c_proj"]


def _tamper(folder, change) -> None:
    path = folder / ADAPTER_WEIGHTS
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda t: t.update(extra=torch.zeros(1)), TensorShapeError, "unexpected"),
        (
            lambda t: t.pop("base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"),
            TensorShapeError,
            "missing",
        ),
        (
            lambda t: t.update(
                {"base_model.model.transformer.h.0.attn.c_attn.lora_B.weight": torch.zeros(3, 4)}
            ),
            TensorShapeError,
            "the model's is",
        ),
        (
            lambda t: t["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].fill_(
                float("nan")
            ),
            CheckpointFolderError,
            "NaN",
        ),
    ],
    ids=["unexpected", "missing", "shape", "nan"],
)
def test_a_tampered_adapter_file_is_refused(change, error, match, tmp_path) -> None:
    make, lora = CASES["gpt2"]
    ours = _adapted(make(), lora, tmp_path)
    save_adapters(ours, lora, adapter_state(ours), tmp_path / "adapter")
    _tamper(tmp_path / "adapter", change)
    with pytest.raises(error, match=match):
        load_adapters(from_pretrained(tmp_path / "base"), tmp_path / "adapter")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"peft_type": "IA3"}, "not LORA"),
        ({"use_dora": True}, "not supported"),
        ({"target_modules": "c_attn"}, "list"),
        ({"lora_alpha": float("inf")}, "number"),
    ],
)
def test_an_adapter_config_we_cannot_honour_is_refused(fields, match, tmp_path) -> None:
    make, lora = CASES["gpt2"]
    ours = _adapted(make(), lora, tmp_path)
    save_adapters(ours, lora, adapter_state(ours), tmp_path / "adapter")
    path = tmp_path / "adapter" / ADAPTER_CONFIG
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))
    with pytest.raises(CheckpointFolderError, match=match):
        load_adapters(from_pretrained(tmp_path / "base"), tmp_path / "adapter")


def test_export_merge_writes_what_transformers_loads_as_pefts_merge(tmp_path, capsys) -> None:
    from transformers import GPT2LMHeadModel

    from fusionllm.node.cli.main import main

    make, lora = CASES["gpt2"]
    ours = _adapted(make(), lora, tmp_path)
    base = str(tmp_path / "base")
    save_adapters(ours, lora, adapter_state(ours), tmp_path / "adapter", base=base)
    out = tmp_path / "merged"
    assert (
        main(["export", "--merge", "--adapter", str(tmp_path / "adapter"), "--out", str(out)]) == 0
    )
    assert str(out) in capsys.readouterr().out
    reference = PeftModel.from_pretrained(make(), tmp_path / "adapter").merge_and_unload()
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    idx = token_ids()
    torch.testing.assert_close(
        hf_logits(loaded, idx), hf_logits(reference, idx), rtol=1e-5, atol=1e-5
    )
    assert main(["export", "--merge", "--out", str(out)]) == 1  # no adapter: a clear error
    assert "--adapter" in capsys.readouterr().err
