"""--model-dir: a Hugging Face folder as the run's model. Its digest (never its path) joins the
run's digests; every builder (stage runtime, facts child, swarm trainer) reads the folder."""

import argparse
import hashlib
import json
from dataclasses import asdict

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.model_folder import model_folder_digest
from fusionllm.common.run_spec import FOLDER, RunSpec
from fusionllm.dag.models import from_pretrained
from fusionllm.node.cli.options import add_run_options, run_spec_from
from fusionllm.node.control.facts_main import model_costs
from fusionllm.node.control.swarm_settings import SwarmSettings
from fusionllm.node.pipeline.train_config import TrainConfig, build_model
from fusionllm.node.swarm_training import parameter_shapes
from tests.support.hf_models import hf_llama

DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_llama(kv_heads=2, vocab=256).save_pretrained(path)  # bytes: the stdlib corpus fits
    return path


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_options(parser)
    return parser.parse_args(argv)


def test_the_digest_covers_the_files_not_the_path(folder, tmp_path) -> None:
    digest = model_folder_digest(folder)
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert model_folder_digest(copy) == digest
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_folder_digest(copy) != digest
    (copy / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        model_folder_digest(copy)


def test_run_digests_take_the_folder_digest_and_ignore_where_it_lies() -> None:
    here = RunSpec(model=FOLDER, model_digest=DIGEST, model_dir="/a")
    there = RunSpec(model=FOLDER, model_digest=DIGEST, model_dir="/elsewhere/b")
    other = RunSpec(model=FOLDER, model_digest="cd" * 32, model_dir="/a")
    assert here.lineage() == there.lineage() != other.lineage()
    settings = [SwarmSettings(run=r).digest() for r in (here, there, other)]
    assert settings[0] == settings[1] != settings[2]
    assert here.model_key == f"folder-{'ab' * 8}"
    # A preset's run keeps the lineage it had before folders existed (old checkpoints load).
    new = ("steps", "model_dir", "model_digest", "lora_rank", "lora_alpha", "lora_fa")
    new += ("lora_targets",)
    old_fields = {k: v for k, v in asdict(RunSpec()).items() if k not in new}
    text = json.dumps(old_fields, sort_keys=True, separators=(",", ":"))
    assert RunSpec().lineage() == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_run_spec_refuses_a_folder_without_digest_and_a_digest_without_folder() -> None:
    with pytest.raises(ConfigError, match="needs a model_digest"):
        RunSpec(model=FOLDER)
    with pytest.raises(ConfigError, match="needs a model_digest"):
        RunSpec(model="tiny", model_digest=DIGEST)
    with pytest.raises(ConfigError, match="model_dir is for model 'folder', not 'tiny'"):
        RunSpec(model="tiny", model_dir="/a")
    with pytest.raises(ConfigError, match="needs a model_digest"):
        RunSpec(model=FOLDER, model_digest="AB" * 32)


def test_model_dir_option_makes_a_folder_run(folder) -> None:
    run = run_spec_from(_args("--model-dir", str(folder)))
    assert run.model == FOLDER
    assert run.model_digest == model_folder_digest(folder)
    assert run.model_dir == str(folder.resolve())
    assert run_spec_from(_args()).model == "tiny"
    with pytest.raises(ConfigError, match="give --model or --model-dir, not both"):
        run_spec_from(_args("--model", "small", "--model-dir", str(folder)))


def test_every_builder_reads_the_folder(folder) -> None:
    run = RunSpec(model=FOLDER, model_digest=DIGEST, model_dir=str(folder), seq_len=16)
    config = TrainConfig.for_run(run, cuts=(), replicas=(1,))
    model = build_model(config)
    reference = from_pretrained(folder)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=0, rtol=0)
    assert parameter_shapes(run) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    costs = model_costs(FOLDER, 16, str(folder))
    assert any(node.node_id.endswith("self_attn_rotary") for node in costs.nodes)


def test_a_folder_whose_vocabulary_is_smaller_than_the_data_is_refused(tmp_path) -> None:
    hf_llama(kv_heads=2, vocab=96).save_pretrained(tmp_path)
    config = TrainConfig(model=FOLDER, model_dir=str(tmp_path), seq_len=16)  # data: bytes
    with pytest.raises(ConfigError, match="has a vocabulary of 96; the data's token ids go up"):
        build_model(config)
    with pytest.raises(ConfigError, match="model 'folder' needs model_dir"):
        build_model(TrainConfig(model=FOLDER, seq_len=16))
