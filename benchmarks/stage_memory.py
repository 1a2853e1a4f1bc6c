"""What a node serving one pipeline stage holds in memory: the stage alone against the whole model.

    python benchmarks/stage_memory.py [--model large] [--stages 4] [--stage 0] [--json PATH]

Each row is one child process that builds stage ``--stage`` of ``--stages`` of GPT-2
``--model`` (GPT-2's real vocabulary of 50257) and serves one micro-batch through it (forward
and backward), then reports its peak RSS (VmHWM) and how long it took:

- whole: the way every node built its stage before: the whole model made real (seeded init,
  or every tensor of the folder read), traced, its stage deep-copied out of it;
- stage: the model built on meta, traced, only the stage's parameters made real (seeded per
  parameter name, or only its tensors read from the folder).

Both from the preset and from a random Hugging Face folder of the same model that the
benchmark writes to a temporary directory first (in its own child process). The children run
one after another, so their peaks do not add up on a shared machine.

Why the ratio is not the stage's share of the parameters (0.34 for stage 0 of GPT-2 large):
both processes hold the stage's parameters and, after the backward, their gradients (as
large again), plus the interpreter and torch (~0.3 GiB); the whole-model one adds the other
stages' parameters. Measured here (2 cores): 2378 MiB alone against 5328 MiB whole (0.45x),
2389 against 5316 MiB from a folder (docs/stage-memory-gpt2-large.json).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_MIB = 1 << 20
_GPT2_VOCAB = 50257


def _peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _config(args: argparse.Namespace):
    from fusionllm.common.run_spec import FOLDER
    from fusionllm.node.pipeline.train_config import TrainConfig

    sizes = dict(
        stages=args.stages, batch_size=args.batch_size, seq_len=args.seq_len, micro_batches=1
    )
    if args.folder:
        return TrainConfig(model=FOLDER, model_dir=args.folder, vocab_size=_GPT2_VOCAB, **sizes)
    return TrainConfig(model=args.model, vocab_size=_GPT2_VOCAB, **sizes)


def _serve_one_micro_batch(worker, layout, stage: int, args: argparse.Namespace) -> None:
    """Forward and backward of one micro-batch through the stage, with made-up inputs."""
    import torch

    b, t = args.batch_size, args.seq_len
    if stage == 0:
        inputs = {"idx": torch.randint(0, 256, (b, t))}  # (B, T)
    else:
        link = layout.links[stage - 1]
        inputs = link.unpack(torch.randn(link.numel))
    targets = torch.randint(0, 256, (b, t)) if worker.is_last else None
    out = worker.forward(0, 0, inputs, targets)
    grads = None if worker.is_last else {name: torch.ones_like(v) for name, v in out.items()}
    worker.backward(0, 0, grads)


def run_child(args: argparse.Namespace) -> dict:
    import torch

    from fusionllm.node.pipeline.stage import OptimizerConfig, StageWorker
    from fusionllm.node.pipeline.train_config import build_layout, build_model, weight_source

    torch.set_num_threads(1)
    config = _config(args)
    start = time.perf_counter()
    alone = args.child == "stage"
    layout = build_layout(config, build_model(config, meta=alone))
    worker = StageWorker(
        layout,
        args.stage,
        optimizer=OptimizerConfig(),
        micro_batches=1,
        weights=weight_source(config) if alone else None,
    )
    _serve_one_micro_batch(worker, layout, args.stage, args)
    held = sum(p.numel() for p in worker.parameters.values())
    total = sum(p.numel() for p in build_model(config, meta=True).parameters())
    return {
        "peak_rss_mib": _peak_rss_bytes() / _MIB,
        "seconds": time.perf_counter() - start,
        "stage_parameters": held,
        "model_parameters": total,
    }


def write_folder(args: argparse.Namespace) -> dict:
    from fusionllm.dag.models import save_pretrained
    from fusionllm.node.pipeline.train_config import TrainConfig, build_model

    start = time.perf_counter()
    model = build_model(TrainConfig(model=args.model, vocab_size=_GPT2_VOCAB, seed=1))
    save_pretrained(model, args.folder)
    return {"peak_rss_mib": _peak_rss_bytes() / _MIB, "seconds": time.perf_counter() - start}


def _child(mode: str, args: argparse.Namespace, folder: str | None) -> dict:
    command = [
        sys.executable, __file__, "--child", mode, "--model", args.model,
        "--stages", str(args.stages), "--stage", str(args.stage),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
    ]  # fmt: skip
    if folder:
        command += ["--folder", folder]
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large", help="a GPT-2 preset (%(default)s)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--stage", type=int, default=0, help="the stage served (%(default)s)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-folder", action="store_true", help="the preset rows only")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per child process")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", choices=("whole", "stage", "write"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 <= args.stage < args.stages:
        parser.error(f"--stage must be in [0, {args.stages}), got {args.stage}")
    if args.child:
        result = write_folder(args) if args.child == "write" else run_child(args)
        print(json.dumps(result))
        return 0
    rows = {}
    with tempfile.TemporaryDirectory(prefix="stage-memory-") as tmp:
        sources = {"preset": None} if args.no_folder else {"preset": None, "folder": tmp}
        if not args.no_folder:
            print(f"writing a random GPT-2 {args.model} folder to {tmp} ...", file=sys.stderr)
            rows["write folder"] = _child("write", args, tmp)
        for source, folder in sources.items():
            for mode in ("whole", "stage"):
                print(f"{source} / {mode} ...", file=sys.stderr)
                rows[f"{source} {mode}"] = _child(mode, args, folder)
    ratios = {
        source: rows[f"{source} stage"]["peak_rss_mib"] / rows[f"{source} whole"]["peak_rss_mib"]
        for source in sources
    }
    title = f"GPT-2 {args.model}, stage {args.stage} of {args.stages}"
    print(f"{title}: peak RSS of one process (VmHWM)")
    print(f"{'row':<16} {'peak MiB':>9} {'seconds':>8} {'stage params':>13}")
    for name, row in rows.items():
        params = row.get("stage_parameters")
        print(
            f"{name:<16} {row['peak_rss_mib']:>9.0f} {row['seconds']:>8.1f} "
            f"{params if params is not None else '':>13}"
        )
    for source, ratio in ratios.items():
        print(f"{source}: stage alone / whole model = {ratio:.3f}")
    if args.json:
        report = {"model": args.model, "stages": args.stages, "stage": args.stage, "rows": rows}
        Path(args.json).write_text(json.dumps({**report, "ratios": ratios}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
