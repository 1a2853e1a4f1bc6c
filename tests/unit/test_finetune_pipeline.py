"""Fine-tuning through the pipeline (in memory): only the adapters are stepped, averaged over
replicas, exchanged and listed; the losses and adapters equal one process's; the base stays."""

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.node.control.swarm_settings import SwarmSettings
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.expectations import TAG_DP, Expectations
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.train_config import TrainConfig, build_layout, build_model
from tests.support.pipeline_threads import ThreadSwarm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def _config(**lora) -> TrainConfig:
    return TrainConfig(
        stages=2, replicas=(1, 2), micro_batches=4, batch_size=2, seq_len=16, steps=4,
        lr=1e-2, max_grad_norm=0.5, **lora,
    )  # fmt: skip


@pytest.mark.parametrize("fa", [False, True], ids=["lora", "lora-fa"])
def test_pipeline_finetune_equals_one_process_and_leaves_the_base_alone(dataset, fa) -> None:
    config = _config(lora_rank=4, lora_alpha=8.0, lora_fa=fa)
    reference = train_local(config, dataset=dataset)
    swarm = ThreadSwarm.trained(config, dataset)
    assert swarm.errors() == {}
    assert swarm.losses() == pytest.approx(reference.losses, abs=1e-5)
    adapters = swarm.parameters()
    suffixes = (".lora_B",) if fa else (".lora_A", ".lora_B")
    assert set(adapters) == set(reference.parameters)
    assert adapters
    assert all(name.endswith(suffixes) for name in adapters)
    for name, tensor in reference.parameters.items():
        torch.testing.assert_close(adapters[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if n.endswith(".lora_B"))
    # The base did not move: every frozen tensor of every stage is still the seeded init.
    start = dict(build_model(config).named_parameters())
    for role, runner in swarm.runners.items():
        for name, p in runner.worker.module.named_parameters():
            if not p.requires_grad:
                canonical = swarm.layout.graph.canonical_parameter_names()[name]
                assert torch.equal(p.detach(), start[canonical].detach()), (role, name)


def test_only_adapters_are_listed_for_optimizer_exchanges_and_state(dataset) -> None:
    config = _config(lora_rank=2, lora_fa=True)
    layout = build_layout(config, build_model(config, meta=True))
    assert layout.tied == {}  # the tied embedding is frozen: nothing to sum between stages
    for stage in range(layout.num_stages):
        names = set(layout.stage_parameter_names(stage).values())
        assert names
        assert all(n.endswith(".lora_B") for n in names)
    module = layout.stage_module(1)
    adapters = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert adapters < 0.1 * sum(p.numel() for p in module.parameters())
    # What a replica of stage 1 may send its peer to average: the adapters' gradients only.
    dp = FrameHeader(step=0, micro_batch=TAG_DP, kind=FrameKind.CONTROL, stage=1)
    assert Expectations(config, layout, Role(1, 0)).expect(dp).shape == (adapters,)


def test_lora_settings_are_part_of_the_run_and_checked() -> None:
    plain = RunSpec()
    assert "lora_rank" not in plain.shared_fields()  # old digests stay as they were
    lora = RunSpec(lora_rank=4)
    assert lora.lineage() != plain.lineage()
    assert RunSpec(lora_rank=4, lora_fa=True).lineage() != lora.lineage()
    assert RunSpec(lora_rank=4, lora_targets=("c_attn",)).lineage() != lora.lineage()
    # Nodes with other adapters never agree on the swarm's settings: never planned together.
    digests = {
        SwarmSettings(run=run).digest()
        for run in (plain, lora, RunSpec(lora_rank=8), RunSpec(lora_rank=4, lora_alpha=8.0))
    }
    assert len(digests) == 4
    with pytest.raises(ConfigError, match="need lora_rank"):
        RunSpec(lora_fa=True)
    with pytest.raises(ConfigError, match="lora_rank"):
        RunSpec(lora_rank=-1)
    run = TrainConfig.for_run(RunSpec(lora_rank=3, lora_alpha=6.0), cuts=(), replicas=(1,))
    assert run.lora is not None
    assert (run.lora.rank, run.lora.scaling) == (3, 2.0)
    with pytest.raises(ConfigError, match="need lora_rank"):
        TrainConfig(lora_targets=("c_attn",))


@pytest.mark.parametrize("command", ["train", "swarm", "node"])
def test_finetune_options_make_the_runs_lora_fields(command) -> None:
    from fusionllm.node.cli.main import build_parser
    from fusionllm.node.cli.options import run_spec_from

    def run(*argv: str) -> RunSpec:
        return run_spec_from(build_parser().parse_args([command, *argv]))

    spec = run(
        "--task", "finetune", "--lora-rank", "8", "--lora-fa", "--lora-targets", "c_attn, c_fc"
    )
    assert (spec.lora_rank, spec.lora_alpha, spec.lora_fa) == (8, 0.0, True)
    assert spec.lora_targets == ("c_attn", "c_fc")
    assert run().lora_rank == 0
    with pytest.raises(ConfigError, match="--lora-rank, --lora-fa need --task finetune"):
        run("--lora-rank", "8", "--lora-fa")
    with pytest.raises(ConfigError, match="--task finetune needs --lora-rank"):
        run("--task", "finetune")
    # With the data loaded (the command is about to run), a target the model lacks is refused.
    argv = ["--task", "finetune", "--lora-rank", "2", "--lora-targets", "q_proj"]
    args = build_parser().parse_args([command, *argv])
    with pytest.raises(ConfigError, match=r"LoRA targets \['q_proj'\] name no linear layer"):
        run_spec_from(args, TokenDataset.from_stdlib(max_bytes=64 << 10).corpus)


def test_a_resumed_finetune_stage_reads_its_frozen_base_and_draws_lora_fas_a_again() -> None:
    """What no checkpoint holds (the base; LoRA-FA's A, never trained) is made again when a
    stage is made real for a checkpoint's import; found by test_finetune_takeover: A left as
    uninitialised memory sent NaN activations after a takeover."""
    from fusionllm.node.pipeline.stage import StageWorker
    from fusionllm.node.pipeline.train_config import weight_source

    config = _config(lora_rank=2, lora_fa=True)
    layout = build_layout(config, build_model(config, meta=True))
    worker = StageWorker(
        layout, 1, optimizer=config.optimizer, micro_batches=4, weights=weight_source(config),
        deferred=True,
    )  # fmt: skip
    worker.make_real(initialise=False)  # a checkpoint's B's come next
    start = dict(build_model(config).named_parameters())
    canonical = layout.graph.canonical_parameter_names()
    frozen = [(n, p) for n, p in worker.module.named_parameters() if not p.requires_grad]
    assert any(n.endswith(".lora_A") for n, _ in frozen)
    for name, p in frozen:
        assert torch.equal(p.detach(), start[canonical[name]].detach()), name
    assert worker.parameters
    assert all(n.endswith(".lora_B") for n in worker.parameters)


def test_train_builds_its_config_from_the_run_as_the_swarm_does() -> None:
    """``fusionllm train`` maps the run spec through ``TrainConfig.for_run`` (it kept a copy
    of the mapping that lacked the optimizer's and the corpus's fields), on ``--stages``
    balanced stages, and refuses a run without end."""
    from fusionllm.node.cli.main import build_parser
    from fusionllm.node.cli.options import run_spec_from
    from fusionllm.node.cli.train_cmd import _train_config

    args = build_parser().parse_args(["train", "--stages", "3", "--steps", "7"])
    config = _train_config(args)
    run = run_spec_from(args)
    assert (config.stages, config.cuts, config.replicas, config.steps) == (3, None, None, 7)
    for field in ("lr", "weight_decay", "betas", "max_grad_norm", "stdlib_bytes", "seed"):
        assert getattr(config, field) == getattr(run, field), field
    with pytest.raises(ConfigError, match="steps must be >= 1, got 0"):
        _train_config(build_parser().parse_args(["train", "--steps", "0"]))
    with pytest.raises(ConfigError, match="give cuts or stages"):
        TrainConfig.for_run(run, cuts=(), stages=2, replicas=None)
