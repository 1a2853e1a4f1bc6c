"""``export``: stages' parameter files in node work dirs -> a folder transformers loads.

The work dirs are written as a training node writes them (``write_model_config`` at start,
``final-params.pt`` of the trainer's format at the end, ``CheckpointStore`` files meanwhile),
from a model cut into stages by the real ``PipelineLayout``.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

from fusionllm.common.run_spec import RunSpec
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_layout,
    build_model,
    model_config,
)
from fusionllm.node.training.checkpoints import CheckpointStore, StageState
from fusionllm.node.training.export import (
    FINAL_PARAMS,
    ExportError,
    export,
    write_model_config,
)
from fusionllm.node.training.holdings import Holding
from fusionllm.node.training.trainer import FINAL_PARAMS as TRAINER_FINAL_PARAMS

STEP = 7


def _run(model: str, stages: int) -> tuple[torch.nn.Module, TrainConfig, object]:
    config = TrainConfig(model=model, stages=stages, batch_size=1, seq_len=16, seed=3)
    torch.manual_seed(0)
    built = build_model(config)
    with torch.no_grad():
        for p in built.parameters():  # away from the seeded init, as training would move it
            p.add_(torch.randn(p.shape) * 0.01)
    return built, config, build_layout(config, built)


def _stage_params(model, layout, stage: int) -> dict[str, torch.Tensor]:
    names = layout.stage_parameter_names(stage)  # stage module name -> canonical
    return {c: model.get_parameter(c).detach().clone() for c in names.values()}


def _node_dir(root: Path, name: str, config: TrainConfig, lineage: str = "L") -> Path:
    folder = root / name
    write_model_config(folder, model_config(config), lineage)
    return folder


def _write_final(folder: Path, params: dict, stage: int, step: int = STEP) -> None:
    data = {"params": params, "stage": stage, "replica": 0, "nodes": [], "step": step, "plan": "p"}
    torch.save(data, folder / FINAL_PARAMS)


def _swarm(root: Path, model, config, layout, *, skip: tuple[int, ...] = ()) -> None:
    """One node per stage, plus a replica of stage 0 (its copy must agree)."""
    for stage in range(layout.num_stages):
        if stage not in skip:
            folder = _node_dir(root, f"node{stage}", config)
            _write_final(folder, _stage_params(model, layout, stage), stage)
    _write_final(_node_dir(root, "replica", config), _stage_params(model, layout, 0), 0)


def _same_logits(folder: Path, model, expected_class) -> None:
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(loaded) is expected_class
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(idx).logits, model.eval()(idx), atol=1e-4, rtol=0)


def test_final_params_name_is_the_trainers() -> None:
    assert FINAL_PARAMS == TRAINER_FINAL_PARAMS


@pytest.mark.parametrize(
    ("name", "stages", "expected_class"),
    [("tiny", 3, GPT2LMHeadModel), ("llama-tiny", 2, LlamaForCausalLM)],
)
def test_a_swarms_stages_export_to_a_folder_transformers_loads(
    tmp_path, name, stages, expected_class
) -> None:
    model, config, layout = _run(name, stages)
    _swarm(tmp_path / "swarm", model, config, layout)
    (tmp_path / "swarm" / "node0.log").write_text("a swarm dir holds logs and keys too")
    out = export([tmp_path / "swarm"], tmp_path / "out")
    _same_logits(out, model, expected_class)


def test_node_dirs_given_one_by_one_export_the_same(tmp_path) -> None:
    model, config, layout = _run("tiny", 2)
    _swarm(tmp_path, model, config, layout)
    out = export([tmp_path / "node0", tmp_path / "node1"], tmp_path / "out")
    _same_logits(out, model, GPT2LMHeadModel)


def test_a_missing_stage_is_named(tmp_path) -> None:
    model, config, layout = _run("tiny", 3)
    _swarm(tmp_path / "a", model, config, layout, skip=(1,))
    with pytest.raises(ExportError, match=r"stage 1 is in no work dir \(found stages \[0, 2\]\)"):
        export([tmp_path / "a"], tmp_path / "out")
    _swarm(tmp_path / "b", model, config, layout, skip=(2,))
    with pytest.raises(ExportError, match="the stage after stage 1 is in no work dir"):
        export([tmp_path / "b"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_copies_that_disagree_and_mixed_runs_are_refused(tmp_path) -> None:
    model, config, layout = _run("tiny", 2)
    _swarm(tmp_path / "s", model, config, layout)
    params = _stage_params(model, layout, 0)
    name = next(iter(params))
    params[name] = params[name] + 1
    _write_final(tmp_path / "s" / "replica", params, 0)
    with pytest.raises(ExportError, match=f"{name} differs between"):
        export([tmp_path / "s"], tmp_path / "out")
    _node_dir(tmp_path / "s", "replica", config, lineage="another run")
    with pytest.raises(ExportError, match="the work dirs trained different runs"):
        export([tmp_path / "s"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"no node work dir \(one with model-config\.json\)"):
        export([tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(ExportError, match="nowhere is not a directory"):
        export([tmp_path / "nowhere"], tmp_path / "out")


def test_without_final_params_the_newest_covered_checkpoint_is_exported(tmp_path) -> None:
    model, config, layout = _run("llama-tiny", 2)
    lineage = RunSpec(model="llama-tiny").lineage()
    ids = layout.graph.node_ids
    bounds = [0, *layout.cuts, len(ids)]
    for stage in range(2):
        folder = _node_dir(tmp_path, f"node{stage}", config, lineage)
        store = CheckpointStore(folder / "checkpoints" / lineage)
        for step, shift in ((4, 0.0), (8, 1.0)):  # step 8 only where stage 0 reached it
            if step == 8 and stage == 1:
                continue
            state = {
                n: torch.cat([(p + shift).flatten(), torch.zeros(2 * p.numel() + 1)])
                for n, p in _stage_params(model, layout, stage).items()
            }
            holding = Holding(step=step, start=bounds[stage], stop=bounds[stage + 1])
            store.save(StageState(holding=holding, state=state, plan="p"))
    out = export([tmp_path], tmp_path / "out")
    _same_logits(out, model, LlamaForCausalLM)  # step 4: the newest both stages hold


def test_the_export_command_writes_the_folder_or_names_the_missing_stage(tmp_path, capsys) -> None:
    from fusionllm.node.cli.main import main

    model, config, layout = _run("tiny", 2)
    _swarm(tmp_path / "w", model, config, layout, skip=(1,))
    assert main(["export", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o")]) == 1
    assert "error: the stage after stage 0 is in no work dir" in capsys.readouterr().err
    _write_final(_node_dir(tmp_path / "w", "node1", config), _stage_params(model, layout, 1), 1)
    assert main(["export", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out) == {"out": str(tmp_path / "o")}
    _same_logits(tmp_path / "o", model, GPT2LMHeadModel)


def test_a_folder_runs_export_keeps_the_source_config_keys(tmp_path) -> None:
    """Token ids and other keys of the config.json the run started from survive the export;
    what described the source file (its dtype, its writer) does not."""
    model, config, layout = _run("llama-tiny", 2)
    source = {"bos_token_id": 5, "eos_token_id": 6, "torch_dtype": "bfloat16",
              "transformers_version": "4.40.0", "my_key": "kept"}  # fmt: skip
    for stage in range(2):
        folder = tmp_path / f"node{stage}"
        write_model_config(folder, model_config(config), "L", like=source)
        _write_final(folder, _stage_params(model, layout, stage), stage)
    out = export([tmp_path], tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["my_key"]) == (5, 6, "kept")
    assert written["dtype"] == "float32"
    assert "torch_dtype" not in written
    assert "transformers_version" not in written
    assert written["hidden_size"] == 64  # ours, not the source's
    _same_logits(out, model, LlamaForCausalLM)
