"""``fusionllm swarm``: a local swarm of real ``fusionllm node`` daemons training together.

It starts N node processes on 127.0.0.1 (own key and work directory each, the first as the
bootstrap) and only watches: the daemons find each other on the DHT, agree on a plan and
train. It hands out no stage and no address. Ctrl-C stops every process it started. At the
end it writes the trained model to WORK_DIR/export/ as a Hugging Face folder.
"""

import argparse
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fusionllm.common.errors import FusionError
from fusionllm.node.cli.config import add_config_option
from fusionllm.node.cli.options import (
    add_data_options,
    add_device_option,
    add_run_options,
    add_task_options,
    load_data,
    run_spec_from,
)

_POLL_S = 0.25
# The summary's last loss is the mean over this many final steps (a quarter of the run at
# most): one step's loss scatters by ~0.3 around the curve at these batch sizes.
_LAST_STEPS = 10


def add_parser(commands) -> None:
    swarm = commands.add_parser(
        "swarm",
        help="start N node daemons on this machine and watch them train together",
        description="Starts --nodes `fusionllm node` processes on 127.0.0.1 (the first is the "
        "bootstrap, each has its own key and work directory). They find each other on the "
        "DHT, agree on a plan without a coordinator and train a model (default: a byte-level "
        "GPT-2 tiny) on --data (default: the bytes of the Python standard library's source). "
        "Shows progress, then a summary, and writes the trained model to WORK_DIR/export/ "
        "(config.json + model.safetensors; with --task finetune, the adapters in PEFT's "
        "layout). Ctrl-C stops every process it started.",
    )
    swarm.add_argument("--nodes", type=int, default=4, help="node daemons (default: %(default)s)")
    add_run_options(swarm)
    add_task_options(swarm)
    add_data_options(swarm)
    add_device_option(swarm)
    swarm.add_argument(
        "--min-stages",
        type=int,
        default=2,
        help="pipeline stages at least; one machine's nodes are equal, so without it a tiny "
        "model would run on one node while the rest wait in backup (default: %(default)s)",
    )
    swarm.add_argument("--max-stages", type=int, default=8, help="(default: %(default)s)")
    swarm.add_argument(
        "--work-dir", help="keys, logs and results of every node (default: a new temp dir)"
    )
    swarm.add_argument(
        "--timeout", type=float, default=3600, help="give up after this many s (%(default)s)"
    )
    swarm.add_argument("--plot", metavar="PNG", help="write the loss curve here")
    swarm.add_argument("--json", action="store_true", help="print one JSON summary at the end")
    swarm.add_argument(
        "--metrics-port",
        type=int,
        metavar="BASE",
        help="serve each node's Prometheus metrics on 127.0.0.1: node i at port BASE + i "
        "(default: off)",
    )
    add_config_option(swarm)  # last: it names every option above
    swarm.set_defaults(handler=run)


@dataclass
class Progress:
    """What the nodes' event streams say, merged: one loss per step, the plan, the ends."""

    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> held-out loss
    step_seconds: dict[int, float] = field(default_factory=dict)
    plan: dict | None = None
    serving: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> its last role
    names: dict[str, str] = field(default_factory=dict)  # peer id -> node name
    bytes_out: dict[str, int] = field(default_factory=dict)
    peak_device_bytes: dict[str, int] = field(default_factory=dict)  # node -> GPU high-water
    finished: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    first_step_at: float | None = None

    def current(self) -> list[list[str]]:
        """Node names per stage of the newest plan the nodes train."""
        if self.plan is None:
            return []
        return [[self.names.get(p, p[:8]) for p in peers] for peers in self.plan["stages"]]

    def absorb(self, name: str, event: dict) -> None:
        kind = event.get("event")
        if kind == "step":
            self.losses.setdefault(event["step"], event["loss"])
            if event.get("eval_loss") is not None:
                self.eval_losses.setdefault(event["step"], event["eval_loss"])
            self.step_seconds.setdefault(event["step"], event["seconds"])
            self.bytes_out[name] = event.get("bytes_out", 0)
            self.peak_device_bytes[name] = event.get("peak_device_bytes", 0)
            if self.first_step_at is None:
                self.first_step_at = time.monotonic()
        elif kind == "ready":
            self.names[event["peer_id"]] = name
        elif kind == "train_plan":
            if self.plan is None or event["start_step"] >= self.plan["start_step"]:
                self.plan = event
            self.serving[name] = (event["stage"], event["replica"])
        elif kind == "finished":
            self.finished.add(name)
        elif kind == "train_error":
            self.errors.append(name)


def _device(device: str, precision: str) -> dict:
    """This machine, measured once (cached) and shared by every node: they are one machine."""
    from dataclasses import asdict

    from fusionllm.node.control.probe import local_device

    return asdict(local_device(None, device, precision))


def _options(args: argparse.Namespace) -> dict:
    from fusionllm.node.local_swarm import CALM

    run = run_spec_from(args)
    return {
        "model": run.model if run.model_dir is None else None,
        "model-dir": run.model_dir,  # each node hashes it again: their digests must agree
        "steps": run.steps,
        "seq-len": run.seq_len,
        "micro-batch-size": run.micro_batch_size,
        "micro-batches": run.micro_batches,
        "lr": run.lr,
        "seed": run.seed,
        "gradient-codec": run.gradient_codec,
        "eval-every": run.eval_every or None,
        "data": str(Path(args.data).expanduser().resolve()) if args.data else None,
        "data-dtype": args.data_dtype,
        "vocab-size": args.vocab_size,
        "precision": run.precision,
        **_task_options(run),
        "device": args.device,  # every node of this machine's swarm on the same device
        "min-stages": args.min_stages,
        "max-stages": args.max_stages,
        "threads": 1,  # N processes share this machine's cores
        "pin-cores": True,  # ... each trainer on its own core (node/training/placement.py)
        **CALM,
    }


def _task_options(run) -> dict:
    """--task finetune and its adapters, as every node gets them."""
    if not run.lora_rank:
        return {}
    return {
        "task": "finetune",
        "lora-rank": run.lora_rank,
        "lora-alpha": run.lora_alpha,
        "lora-fa": run.lora_fa,
        "lora-targets": ",".join(run.lora_targets) or None,
    }


def run(args: argparse.Namespace) -> int:
    from fusionllm.node.local_swarm import LocalSwarm

    if args.nodes < 1:
        raise FusionError(f"--nodes must be >= 1, got {args.nodes}")
    if args.steps < 1:
        raise FusionError("a local swarm needs an end: --steps must be >= 1")
    if args.min_stages > args.nodes:
        raise FusionError(f"--min-stages {args.min_stages} needs at least as many --nodes")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65536 - args.nodes:
        raise FusionError(f"--metrics-port {args.metrics_port}: ports BASE..BASE+{args.nodes - 1} "
                          "must lie within 1..65535")  # fmt: skip
    _check_folder(run_spec_from(args, load_data(args)))  # validate before starting anything
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="fusionllm-swarm-")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else _print
    say(f"starting {args.nodes} node daemons on 127.0.0.1 (work dir {root})")
    swarm = LocalSwarm(root, extra=_options(args), device=_device(args.device, args.precision))
    launched = time.monotonic()
    try:
        progress = _watch(swarm, args, say)
    finally:
        for node in swarm.nodes:  # politely: a node that still runs leaves the swarm
            node.kill(signal.SIGTERM)
    exported = _export(root)
    what = (
        "adapters, in PEFT's layout"
        if args.task == "finetune"
        else "model, as a Hugging Face folder"
    )
    say(f"the trained {what}: {exported}")
    return _report(progress, args, root, launched, say, exported)


def _check_folder(run) -> None:
    """A folder this run cannot train is one error here, not a train_error from every node
    after they met: its vocabulary must cover the data's ids, its positions the sequence."""
    if run.model_dir is None:
        return
    from fusionllm.dag.models import read_config

    config = read_config(run.model_dir)
    if config.vocab_size < run.vocab_size:
        raise FusionError(
            f"{run.model_dir} has a vocabulary of {config.vocab_size}; the data's token ids go "
            f"up to {run.vocab_size - 1} (prepare it with the folder's tokenizer)"
        )
    if run.seq_len > config.block_size:
        raise FusionError(
            f"--seq-len {run.seq_len} exceeds {run.model_dir}'s {config.block_size} positions"
        )


def _export(root: Path) -> Path:
    from fusionllm.node.training.export import export

    return export([root], root / "export")


def _print(*parts) -> None:
    print(*parts, flush=True)


def _watch(swarm, args: argparse.Namespace, say) -> Progress:
    from tqdm import tqdm

    first = swarm.start("node0", extra=_metrics(args, 0, say))
    deadline = time.monotonic() + args.timeout
    while first.last("ready") is None:
        _check_alive(swarm, deadline)
        time.sleep(_POLL_S)
    for i in range(1, args.nodes):
        swarm.start(f"node{i}", bootstrap=first.dht_addr, extra=_metrics(args, i, say))
    progress, seen = Progress(), {}
    bar = tqdm(total=args.steps, unit="step", disable=args.json, file=sys.stdout)
    with bar:
        while len(progress.finished) < len(progress.serving) or not progress.serving:
            for node in swarm.nodes:
                events = node.snapshot()
                for event in events[seen.get(node.name, 0) :]:
                    progress.absorb(node.name, event)
                seen[node.name] = len(events)
            _update_bar(bar, progress, args)
            if progress.errors:
                raise FusionError(f"training failed on {progress.errors}; logs in {swarm.root}")
            _check_alive(swarm, deadline, progress)
            time.sleep(_POLL_S)
    return progress


def _metrics(args: argparse.Namespace, i: int, say) -> dict:
    if args.metrics_port is None:
        return {}
    say(f"node{i}'s metrics at http://127.0.0.1:{args.metrics_port + i}/metrics")
    return {"metrics": f"127.0.0.1:{args.metrics_port + i}"}


def _update_bar(bar, progress: Progress, args: argparse.Namespace) -> None:
    done = len(progress.losses)
    if done > bar.n:
        bar.update(done - bar.n)
        last = max(progress.losses)
        tokens = run_spec_from(args).tokens_per_step / max(progress.step_seconds[last], 1e-9)
        stages = " | ".join(f"s{s}:" + ",".join(n) for s, n in enumerate(progress.current()))
        bar.set_postfix_str(f"loss {progress.losses[last]:.4f} {tokens:,.0f} tok/s [{stages}]")


def _check_alive(swarm, deadline: float, progress: Progress | None = None) -> None:
    if time.monotonic() > deadline:
        raise FusionError(f"the swarm did not finish in time; logs in {swarm.root}")
    for node in swarm.nodes:
        if not node.alive() and (progress is None or node.name not in progress.finished):
            code = node.process.poll()
            if progress is None or node.name in progress.serving or code != 0:
                raise FusionError(
                    f"{node.name} exited with {code}; its log: {swarm.root / (node.name + '.log')}"
                )


def _report(progress: Progress, args, root: Path, launched: float, say, exported: Path) -> int:
    steps = sorted(progress.losses)
    tokens_per_step = run_spec_from(args).tokens_per_step
    steady = [progress.step_seconds[s] for s in steps[len(steps) // 4 :]]
    seconds = sorted(steady)[len(steady) // 2] if steady else float("nan")
    last = steps[-min(_LAST_STEPS, max(1, len(steps) // 4)) :]
    evals = sorted(progress.eval_losses)
    summary = {
        "steps": len(steps),
        "loss_first": progress.losses[steps[0]] if steps else None,
        "loss_last": sum(progress.losses[s] for s in last) / len(last) if last else None,
        "loss_last_steps": len(last),  # loss_last is their mean
        "eval_losses": {str(s): progress.eval_losses[s] for s in evals},
        "eval_loss_last": progress.eval_losses[evals[-1]] if evals else None,
        "tokens_per_s": tokens_per_step / seconds if steady else None,
        "nodes": args.nodes,
        "plan_digest": progress.plan["digest"] if progress.plan else None,
        "stages": len(progress.plan["stages"]) if progress.plan else None,
        # the plan's cuts and link codecs: a launcher run of the same plan compares equal work
        "ranges": progress.plan.get("ranges") if progress.plan else None,
        "wire": progress.plan.get("wire") if progress.plan else None,
        "peak_device_bytes": dict(sorted(progress.peak_device_bytes.items())),
        "export": str(exported),
    }
    if args.plot:
        _plot(progress, Path(args.plot))
    if args.json:
        print(json.dumps(summary))
        return 0
    plan = progress.plan or {}
    say(
        f"done: {summary['steps']} steps, loss {summary['loss_first']:.4f} -> "
        f"{summary['loss_last']:.4f} (mean of the last {len(last)}), "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median of the last 3/4), first step "
        f"{progress.first_step_at - launched:.1f}s after launch"
    )
    if evals:
        say(f"validation loss {summary['eval_loss_last']:.4f} at step {evals[-1]} (held-out)")
    say(f"plan {str(plan.get('digest'))[:12]}: node ranges per stage {plan.get('ranges')}")
    for name, (stage, replica) in sorted(progress.serving.items()):
        say(
            f"  {name}: stage {stage} replica {replica}, {progress.bytes_out.get(name, 0):,} B sent"
        )
    say(f"results and logs: {root}")
    return 0


def _plot(progress: Progress, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(progress.losses)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [progress.losses[s] for s in steps])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("fusionllm swarm: training loss")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
