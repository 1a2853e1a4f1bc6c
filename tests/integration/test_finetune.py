"""Issue 29's fine-tuning, as a user runs it: ``fusionllm train --task finetune`` on a Hugging
Face folder transformers wrote (random weights, nothing downloaded), with LoRA on a GPT-2 and
LoRA-FA on a Llama, two stage processes each (both runs at once, to keep CI time down). The
loss goes down; the pipeline trained what one process trains; PEFT (test-only) loads the saved
adapters onto transformers' model with the same logits as our adapted model; and
``fusionllm export --merge`` writes what PEFT's merge_and_unload gives.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from fusionllm.dag.models import from_pretrained
from fusionllm.dag.models.lora_io import load_adapters
from fusionllm.data.corpus import stdlib_source_files
from fusionllm.node.cli.main import build_parser, main
from fusionllm.node.cli.train_cmd import _train_config
from fusionllm.node.pipeline.local_train import train_local
from tests.support.hf_models import VOCAB, hf_gpt2, hf_llama, hf_logits, token_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 15
RUNS = {
    "gpt2-lora": (hf_gpt2, ["--lora-rank", "4", "--lora-alpha", "8"]),
    "llama-lora-fa": (hf_llama, ["--lora-rank", "4", "--lora-alpha", "16", "--lora-fa"]),
}


def _tokens(path: Path) -> Path:
    """Python source as ids below the folders' vocabulary: printable ASCII shifted to 0..94."""
    text = b"".join(p.read_bytes() for p in stdlib_source_files()[:3])[: 96 << 10]
    ids = np.clip(np.frombuffer(text, dtype=np.uint8).astype(np.int64) - 32, 0, VOCAB - 2)
    ids.astype(np.uint16).tofile(path)
    return path


def _argv(tmp_path: Path, name: str) -> list[str]:
    return [
        "train", "--model-dir", str(tmp_path / name / "base"), "--data", str(tmp_path / "tokens"),
        "--task", "finetune", *RUNS[name][1], "--steps", str(STEPS), "--seq-len", "32",
        "--micro-batches", "4", "--micro-batch-size", "2", "--lr", "1e-2", "--device", "cpu",
        "--adapter-out", str(tmp_path / name / "adapter"), "--json",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Both fine-tunes, run at once as two `fusionllm train` commands; their JSON lines."""
    tmp_path = tmp_path_factory.mktemp("finetune")
    _tokens(tmp_path / "tokens")
    processes = {}
    for name, (make, _) in RUNS.items():
        make().save_pretrained(tmp_path / name / "base")
        command = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING"]
        processes[name] = subprocess.Popen(
            [*command, *_argv(tmp_path, name)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
    lines = {}
    try:
        for name, process in processes.items():
            out, err = process.communicate(timeout=480)
            assert process.returncode == 0, err[-3000:]
            lines[name] = [json.loads(line) for line in out.splitlines()]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return tmp_path, lines


@pytest.mark.parametrize("name", sorted(RUNS))
def test_finetune_lowers_the_loss_as_one_process_does(runs, name) -> None:
    tmp_path, lines = runs
    losses = [line["loss"] for line in lines[name] if "step" in line]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses  # from ~ln(96) = 4.56
    assert lines[name][-1] == {"adapter": str(tmp_path / name / "adapter")}
    # The same run in one process: the same losses, and the adapters the pipeline saved.
    config = _train_config(build_parser().parse_args(_argv(tmp_path, name)))
    reference = train_local(config)
    assert losses == pytest.approx(reference.losses, abs=1e-4)
    ours = from_pretrained(tmp_path / name / "base")
    load_adapters(ours, tmp_path / name / "adapter")
    saved = dict(ours.named_parameters())
    for key, tensor in reference.parameters.items():
        torch.testing.assert_close(saved[key], tensor, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_peft_loads_the_adapters_and_export_merge_is_its_merge(runs, name) -> None:
    tmp_path, _ = runs
    base, adapter = tmp_path / name / "base", tmp_path / name / "adapter"
    ours = from_pretrained(base)
    load_adapters(ours, adapter)
    idx = token_ids(length=32)
    with torch.no_grad():
        expected = ours(idx)  # (B, T, V)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    torch.testing.assert_close(hf_logits(peft_model.eval(), idx), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain = from_pretrained(base)(idx)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the adapters changed something
    merged = tmp_path / name / "merged"
    assert main(["export", "--merge", "--adapter", str(adapter), "--out", str(merged)]) == 0
    reference = hf_logits(peft_model.merge_and_unload(), idx)
    loaded = AutoModelForCausalLM.from_pretrained(merged).eval()
    torch.testing.assert_close(hf_logits(loaded, idx), reference, rtol=1e-5, atol=1e-5)
