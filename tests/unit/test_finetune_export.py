"""``export`` of a fine-tune's work dirs: the stages' adapters (all a node saves of a fine-tune)
-> one folder in PEFT's layout, LoRA-FA's never-trained A drawn again from the run's seed."""

import pytest
import torch

from fusionllm.dag.models.lora_io import ADAPTER_CONFIG, load_adapters
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_layout,
    build_model,
    model_config,
)
from fusionllm.node.training.export import (
    FINAL_PARAMS,
    ExportError,
    export,
    lora_record,
    write_model_config,
)


@pytest.mark.parametrize("fa", [False, True], ids=["lora", "lora-fa"])
def test_a_finetunes_stages_export_as_one_peft_folder(tmp_path, fa) -> None:
    config = TrainConfig(
        model="tiny", stages=2, batch_size=1, seq_len=16, seed=3, lora_rank=2, lora_fa=fa
    )
    tuned = build_model(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in tuned.parameters():
            if p.requires_grad:  # as training moves the adapters
                p.add_(torch.randn(p.shape) * 0.05)
    layout = build_layout(config, tuned)
    assert config.lora is not None
    record = lora_record(config.lora, config.seed, base=None)
    for stage in range(layout.num_stages):
        folder = tmp_path / "work" / f"node{stage}"
        write_model_config(folder, model_config(config), "L", lora=record)
        names = layout.stage_parameter_names(stage).values()  # what the stage trains
        params = {c: tuned.get_parameter(c).detach().clone() for c in names}
        data = {"params": params, "stage": stage, "replica": 0, "step": 9, "plan": "p"}
        torch.save(data, folder / FINAL_PARAMS)
    out = export([tmp_path / "work"], tmp_path / "adapter")
    assert (out / ADAPTER_CONFIG).is_file()
    base = build_model(TrainConfig(model="tiny", stages=2, batch_size=1, seq_len=16, seed=3))
    load_adapters(base, out)
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(base(idx), tuned(idx), rtol=0, atol=0)
    # A stage's adapters missing is named, as for a full model.
    (tmp_path / "work" / "node1" / FINAL_PARAMS).unlink()
    with pytest.raises(ExportError, match="the stage after stage 0 is in no work dir"):
        export([tmp_path / "work"], tmp_path / "again")
