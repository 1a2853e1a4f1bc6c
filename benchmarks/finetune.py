"""Full fine-tuning, LoRA and LoRA-FA on GPT-2 small's shapes: what trains, what each pipeline
stage keeps for backward, and where the loss gets in a fixed number of steps.

    python benchmarks/finetune.py [--model small] [--stages 2] [--rank 8] [--seq-len 256]
                                  [--batch 4] [--steps 30] [--loss-seq-len 64] [--json PATH]

Random weights (seeded, nothing downloaded), byte-level vocabulary, LoRA on every linear layer
of a block (c_attn, c_proj, c_fc), alpha = 2 x rank. Per method:

- ``trainable``: parameters the optimizer steps (full: all of them; LoRA: A and B; LoRA-FA: B);
- ``saved_mib`` per stage: the activation memory one micro-batch of ``--batch`` x ``--seq-len``
  holds from its forward until its backward, measured on the pipeline's own ``StageWorker``
  with saved-tensor hooks (each tensor once, parameters left out): the training peak of a
  stage, per micro-batch in flight; ``estimate_mib``: what the OP-DAG's cost rules (which
  the planner uses) say for the same stage;
- ``loss``: the mean loss of the last 5 of ``--steps`` steps of one process training on the
  same data from the same weights (``train_local``, which the pipeline equals: unit tests),
  at ``--loss-seq-len`` tokens (CPU time).

Measured here (2 shared cores, defaults: 2 stages, rank 8, 4 x 256 tokens; docs/finetune-gpt2-
small.json), saved MiB per stage (the estimate) and the loss after 30 steps at lr 1e-3:
full 86,039,040 trainable, 288.4 (306.3) / 295.4 (312.3), 5.422 -> 3.178;
LoRA 1,179,648, 286.1 (304.0) / 293.1 (310.0), -> 3.321;
LoRA-FA 663,552, 178.1 (178.0) / 185.1 (184.0), -> 3.314.
LoRA keeps what full fine-tuning keeps (each adapted layer's input, now for A's gradient
instead of W's); LoRA-FA keeps 1.6x less than either (the paper: up to 1.4x less than LoRA).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_layout,
    build_model,
    weight_source,
)

_MIB = 1 << 20
METHODS = ("full", "lora", "lora-fa")


def _config(args: argparse.Namespace, method: str, **overrides) -> TrainConfig:
    lora = {} if method == "full" else {"lora_rank": args.rank, "lora_alpha": 2.0 * args.rank}
    fields = {
        "model": args.model, "stages": args.stages, "micro_batches": 1, "batch_size": args.batch,
        "seq_len": args.seq_len, "steps": args.steps, "lr": args.lr, "seed": 0,
        "lora_fa": method == "lora-fa", **lora,
    } | overrides  # fmt: skip
    return TrainConfig(**fields)


def _saved_bytes(run, parameters: set[int]) -> int:
    """Bytes of the distinct tensors autograd keeps while ``run()`` executes, leaving out those
    whose storage is in ``parameters`` (weights are not activations)."""
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = max(kept.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def stage_memory(config: TrainConfig) -> list[dict]:
    """Per stage: measured and estimated activation bytes of one micro-batch."""
    layout = build_layout(config, build_model(config, meta=True))
    idx = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len))  # (B, T)
    values: dict[str, torch.Tensor] = {layout.graph.input_names[0]: idx}
    rows = []
    for stage in range(layout.num_stages):
        worker = StageWorker(
            layout,
            stage,
            optimizer=config.optimizer,
            micro_batches=1,
            weights=weight_source(config),
        )
        parameters = {p.untyped_storage().data_ptr() for p in worker.module.parameters()}
        out: dict[str, torch.Tensor] = {}

        def forward(worker=worker, values=values, out=out) -> None:
            out.update(worker.forward(0, 0, values, targets=idx))

        saved = _saved_bytes(forward, parameters)
        estimate = sum(layout.graph.node(n).peak_activation_bytes for n in layout.stages[stage])
        rows.append(
            {
                "stage": stage,
                "saved_mib": round(saved / _MIB, 2),
                "estimate_mib": round(estimate / _MIB, 2),
                "trainable": worker.num_parameters(),
            }
        )
        worker.drop(0)
        values = out
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="GPT-2 preset (%(default)s)")
    parser.add_argument("--stages", type=int, default=2, help="(%(default)s)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=256, help="memory rows (%(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences (%(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="loss rows (%(default)s)")
    parser.add_argument("--loss-seq-len", type=int, default=64, help="(%(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW, all methods (%(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for method in METHODS:
        started = time.monotonic()
        stages = stage_memory(_config(args, method))
        trained = train_local(_config(args, method, stages=1, seq_len=args.loss_seq_len))
        losses = trained.losses
        rows.append(
            {
                "method": method,
                "trainable": sum(p.numel() for p in trained.parameters.values()),
                "stages": stages,
                "first_loss": round(losses[0], 4),
                "loss": round(sum(losses[-5:]) / len(losses[-5:]), 4),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
        print(_line(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


def _line(row: dict) -> str:
    saved = " ".join(f"{s['saved_mib']:.1f}({s['estimate_mib']:.1f})" for s in row["stages"])
    return (
        f"{row['method']:>8}  trainable {row['trainable']:>11,}  saved MiB per stage "
        f"(estimate) {saved}  loss {row['first_loss']:.3f} -> {row['loss']:.3f}  "
        f"{row['seconds']:.0f}s"
    )


if __name__ == "__main__":
    sys.exit(main())
