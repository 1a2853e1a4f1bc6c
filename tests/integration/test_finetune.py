"""Issue 29's fine-tuning, as a user runs it: ``fusionllm train --task finetune`` on a Hugging
Face folder transformers wrote (random weights, nothing downloaded), with LoRA on a GPT-2 and
LoRA-FA on a Llama, two stage processes each, and ``fusionllm swarm --task finetune`` (two node
daemons that plan, train and export by themselves) with LoRA-FA on two of GPT-2's layer kinds;
the two train runs at once, to keep CI time down. The loss goes down; the pipeline trained what
one process trains; PEFT (test-only) loads the saved adapters onto transformers' model with
the same logits as our adapted model; ``fusionllm export --merge`` writes what PEFT's
merge_and_unload gives.
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


SWARM = "gpt2-swarm-lora-fa"


def _swarm_argv(tmp_path: Path) -> list[str]:
    return [
        "swarm", "--nodes", "2", "--model-dir", str(tmp_path / SWARM / "base"),
        "--data", str(tmp_path / "tokens"), "--task", "finetune", "--lora-rank", "4",
        "--lora-fa", "--lora-targets", "c_attn,c_fc", "--steps", str(STEPS), "--seq-len", "32",
        "--lr", "1e-2", "--device", "cpu", "--work-dir", str(tmp_path / SWARM / "work"), "--json",
    ]  # fmt: skip


def _run_at_once(commands: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Run these CLI commands side by side; each one's JSON lines once all have succeeded."""
    prefix = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    processes = {
        name: subprocess.Popen([*prefix, *argv], **pipes) for name, argv in commands.items()
    }
    lines = {}
    try:
        for name, process in processes.items():
            out, err = process.communicate(timeout=400)
            assert process.returncode == 0, err[-3000:]
            lines[name] = [json.loads(line) for line in out.splitlines()]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()  # politely: a swarm stops the daemons it started
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    return lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """The two `fusionllm train` fine-tunes side by side, then the swarm's (three at once
    outran the launcher's 60 s start on a loaded 2-core host); their JSON lines."""
    tmp_path = tmp_path_factory.mktemp("finetune")
    _tokens(tmp_path / "tokens")
    for name, (make, _) in RUNS.items():
        make().save_pretrained(tmp_path / name / "base")
    lines = _run_at_once({name: _argv(tmp_path, name) for name in RUNS})
    hf_gpt2().save_pretrained(tmp_path / SWARM / "base")
    lines |= _run_at_once({SWARM: _swarm_argv(tmp_path)})
    return tmp_path, lines


def test_a_two_node_swarm_finetunes_and_exports_adapters_peft_loads(runs) -> None:
    tmp_path, lines = runs
    summary = lines[SWARM][-1]
    assert (summary["steps"], summary["stages"], summary["nodes"]) == (STEPS, 2, 2)
    assert summary["loss_last"] < summary["loss_first"] - 0.3, summary
    work = tmp_path / SWARM / "work"
    for path in sorted(work.glob("node*/final-params.pt")):  # each node kept its B's only
        names = torch.load(path, weights_only=True)["params"]
        assert names
        assert all(n.endswith((".c_attn.lora_B", ".c_fc.lora_B")) for n in names), sorted(names)
    adapter = Path(summary["export"])
    assert adapter == work / "export"
    base = tmp_path / SWARM / "base"
    ours = from_pretrained(base)
    assert load_adapters(ours, adapter).targets == ("c_attn", "c_fc")
    idx = token_ids(length=32)
    with torch.no_grad():
        expected, plain = ours(idx), from_pretrained(base)(idx)
    assert not torch.allclose(expected, plain, atol=1e-3)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    torch.testing.assert_close(hf_logits(peft_model.eval(), idx), expected, rtol=1e-5, atol=1e-5)


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
