"""`fusionllm swarm --model-dir`: node daemons train a Llama folder transformers wrote, and the
export it leaves loads back in transformers with the swarm's final parameters."""

import json
import subprocess
import sys

import pytest
import torch

from fusionllm.dag.models import from_pretrained
from tests.support.hf_models import hf_llama

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 20


def test_a_swarm_trains_a_hugging_face_folder_and_exports_it(tmp_path):
    from transformers import LlamaForCausalLM

    folder = tmp_path / "llama"
    hf_llama(kv_heads=2, vocab=256).save_pretrained(folder)  # random weights, GQA, bytes
    work = tmp_path / "w"
    result = subprocess.run(
        [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING", "swarm",
         "--model-dir", str(folder), "--nodes", "2", "--steps", str(STEPS), "--seq-len", "16",
         "--work-dir", str(work), "--json"],
        capture_output=True, text=True, timeout=360, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS
    assert summary["loss_last"] < summary["loss_first"] - 0.3, summary
    final = {}
    for node in ("node0", "node1"):
        saved = torch.load(work / node / "final-params.pt", weights_only=True)
        final.update(saved["params"])
    ours = from_pretrained(folder)
    assert set(final) == set(ours.state_dict())  # untied: every parameter under its own name
    assert not torch.equal(final["model.norm.weight"], ours.model.norm.weight)  # it trained
    ours.load_state_dict(final)
    exported = json.loads((work / "export" / "config.json").read_text())
    assert exported["bos_token_id"] == exported["eos_token_id"] == 0  # the source's, kept
    loaded, info = LlamaForCausalLM.from_pretrained(work / "export", output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(idx).logits, ours.eval()(idx), atol=1e-4, rtol=0)
