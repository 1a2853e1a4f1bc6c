"""GPU check: one process vs a 2-stage pipeline on one GPU, bf16 throughput and fp32 equality.

    python benchmarks/gpu.py [--json PATH]                      (a machine with a GPU, < 8 min)
    python benchmarks/gpu.py --device cpu --models tiny --steps 4 --seq-len 32 \\
        --micro-batch-size 2 --micro-batches 4                 (the same phases on a CPU, seconds)

Phases, each in a child process of its own (so each has its own peak-memory counter and a
hung phase is killed at its time limit; the others still run):

- ``env``: device name, torch and CUDA versions, a bf16 matmul's FLOP/s (the achievable peak);
- ``local/<model>/bf16``: the whole model in one process (``train_local``) on the device;
- ``pipeline/<model>/bf16``: 2 stage processes on the same device, over the real transport
  (TCP lanes on 127.0.0.1), started by the launcher (``run_swarm``, what ``fusionllm train``
  runs), with balanced cuts: the rows compare the same layout;
- ``local/<model>/fp32`` and ``pipeline/<model>/fp32`` (the first model): the same run in fp32,
  losses and final parameters compared (must agree to 1e-4);
- ``swarm/<model>/bf16`` (the first model, last: it needs the most time): ``fusionllm swarm``,
  2 real ``fusionllm node`` daemons (DHT, plan agreement, READY barrier) held to 2 stages; the
  planner picks their cuts, so its layout may differ from the launcher's.

Per row: tokens/s (median step after the warm-up steps), model FLOPs utilisation (6N + 12 L d T
FLOPs per token, N the parameters counted once, over the device's peak: ``--peak-tflops``, a
known GPU's bf16 dense peak, else the measured matmul's), peak device memory per process.
GPT-2 here is byte-level (vocabulary 256: no tokenizer to download), so N is below the
50,257-token GPT-2's. Progress goes to stdout as it happens; ``--json`` is rewritten after
every phase, so a run cut short still leaves what it measured.
"""

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bf16 dense tensor-core peaks (no sparsity), TFLOP/s, by a part of the device name.
_PEAKS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
          ("L40S", 362.0), ("A10G", 70.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0))  # fmt: skip
_TOTAL_BUDGET_S = 450.0  # all phases; the check must end within 8 minutes
_EQUAL_ATOL = 1e-4


def say(text: str) -> None:
    print(text, flush=True)


# ----- the phases (each runs in a child: python gpu.py --phase NAME --out FILE) --------------


def _config(args: argparse.Namespace, model: str, precision: str, stages: int, steps: int):
    from fusionllm.node.pipeline.train_config import TrainConfig

    return TrainConfig(
        model=model, stages=stages, micro_batches=args.micro_batches,
        batch_size=args.micro_batch_size, seq_len=args.seq_len, steps=steps, lr=3e-4,
        precision=precision, stdlib_bytes=4 << 20,
    )  # fmt: skip


def _flops_per_token(config) -> float:
    """6N + 12 L d T (PaLM's appendix B; nanoGPT's estimate_mfu), N counted once when tied."""
    import torch

    from fusionllm.dag.models.gpt2 import PRESETS

    with torch.device("meta"):
        from fusionllm.node.pipeline.train_config import build_model

        model = build_model(config)
    n = sum(p.numel() for p in model.parameters())
    sizes = PRESETS[config.model]
    return 6.0 * n + 12.0 * sizes.n_layer * sizes.n_embd * config.seq_len


def phase_env(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fusionllm.node.pipeline.compute import resolve_device

    device = resolve_device(args.device)
    out: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpus": os.cpu_count()}  # fmt: skip
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
        out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize(device)
        started, reps = time.perf_counter(), 20
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize(device)
        out["matmul_tflops"] = 2 * n**3 * reps / (time.perf_counter() - started) / 1e12
    else:
        out["name"] = "cpu"
    return out


def phase_local(args: argparse.Namespace, model: str, precision: str) -> dict[str, Any]:
    import torch

    from fusionllm.node.pipeline.compute import Compute
    from fusionllm.node.pipeline.local_train import train_local

    compute = Compute.of(args.device, precision)
    config = _config(args, model, precision, 1, args.steps)
    stamps = [time.perf_counter()]

    def on_step(step: int, loss: float) -> None:  # float(loss) already waited for the step
        stamps.append(time.perf_counter())
        say(f"    step {step}  loss {loss:.4f}  {stamps[-1] - stamps[-2]:.3f}s")

    if compute.is_cuda:
        # The allocator's statistics exist once the device holds memory: resetting them before
        # raised "Invalid device argument" on an H200 (torch 2.11).
        torch.empty(1, device=compute.device)
        torch.cuda.reset_peak_memory_stats(compute.device)
    run = train_local(config, on_step=on_step, compute=compute)
    seconds = [b - a for a, b in itertools.pairwise(stamps)][args.warmup :]
    out = _throughput(config, statistics.median(seconds))
    out["losses"] = run.losses
    out["peak_device_bytes"] = (
        [int(torch.cuda.max_memory_allocated(compute.device))] if compute.is_cuda else []
    )
    if args.params_out:
        torch.save(run.parameters, args.params_out)
    return out


def phase_pipeline(args: argparse.Namespace, model: str, precision: str) -> dict[str, Any]:
    import torch

    from fusionllm.node.pipeline.launcher import run_swarm

    config = _config(args, model, precision, 2, args.steps)

    def on_step(event: dict) -> None:
        say(f"    step {event['step']}  loss {event['loss']:.4f}  {event['seconds']:.3f}s")

    result = run_swarm(
        config, device=args.device, threads=args.threads, on_step=on_step, pin_cores=True,
        start_timeout_s=120.0, step_timeout_s=120.0,
    )  # fmt: skip
    by_step: dict[int, float] = {}  # a step ends when its slowest process ends it
    for event in result.steps:
        by_step[event["step"]] = max(by_step.get(event["step"], 0.0), event["seconds"])
    seconds = [by_step[s] for s in sorted(by_step)][args.warmup :]
    out = _throughput(config, statistics.median(seconds))
    out["losses"] = result.losses
    done = sorted(result.done, key=lambda e: (e["stage"], e["replica"]))
    out["peak_device_bytes"] = [e["peak_device_bytes"] for e in done if "peak_device_bytes" in e]
    out["bytes_out"] = [e["bytes_out"] for e in done]
    if args.params_out:
        torch.save(result.parameters, args.params_out)
    return out


def phase_swarm(args: argparse.Namespace, model: str, precision: str) -> dict[str, Any]:
    """``fusionllm swarm``: 2 real node daemons (DHT, plan agreement, READY barrier) on the
    device, held to 2 stages; its own --timeout ends it (and its nodes) before our limit."""
    config = _config(args, model, precision, 2, args.steps)
    own_limit = max(args.limit - 30.0, 10.0)
    work_dir = str(Path(args.out).parent / f"swarm-{model}")
    argv = [sys.executable, "-m", "fusionllm.node.cli.main", "swarm", "--nodes", "2",
            "--min-stages", "2", "--max-stages", "2", "--model", model, "--precision",
            precision, "--device", args.device, "--steps", str(args.steps), "--seq-len",
            str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
            "--micro-batches", str(args.micro_batches), "--lr", "3e-4", "--timeout",
            str(own_limit), "--json", "--work-dir", work_dir]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        stdout, _ = process.communicate(timeout=own_limit + 15.0)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # Ctrl-C: the command stops its nodes
        process.communicate(timeout=10.0)
        raise TimeoutError(f"fusionllm swarm ran past {own_limit:.0f}s") from None
    if process.returncode != 0 or not stdout.strip():
        raise RuntimeError(f"fusionllm swarm exited with code {process.returncode}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    out = _throughput(config, config.tokens_per_step / summary["tokens_per_s"])
    out["losses"] = [summary["loss_first"], summary["loss_last"]]
    out["peak_device_bytes"] = list(summary["peak_device_bytes"].values())
    out["plan_stages"] = summary["stages"]
    # The planner's own cuts and link codecs (AdaTopK may compress a loopback link that the
    # launcher's row sends dense): compare rows only where these match.
    out["plan_ranges"], out["plan_wire"] = summary.get("ranges"), summary.get("wire")
    return out


def _throughput(config, step_s: float) -> dict[str, Any]:
    tokens_per_s = config.tokens_per_step / step_s
    return {"model": config.model, "precision": config.precision, "stages": config.stages,
            "tokens_per_step": config.tokens_per_step, "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "model_tflops": tokens_per_s * _flops_per_token(config) / 1e12}  # fmt: skip


def run_phase(args: argparse.Namespace) -> int:
    kind, _, rest = args.phase.partition("/")
    if kind == "env":
        out = phase_env(args)
    else:
        model, precision = rest.split("/")
        run = {"local": phase_local, "pipeline": phase_pipeline, "swarm": phase_swarm}[kind]
        out = run(args, model, precision)
    Path(args.out).write_text(json.dumps(out))
    return 0


# ----- the driver ----------------------------------------------------------------------------


def _phases(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(phase, time limit in s), most important first: what a short run must not miss."""
    first = args.models[0]
    phases = [("env", 60.0), (f"local/{first}/bf16", 60.0), (f"pipeline/{first}/bf16", 120.0),
              (f"local/{first}/fp32", 60.0), (f"pipeline/{first}/fp32", 120.0)]  # fmt: skip
    for model in args.models[1:]:
        phases += [(f"local/{model}/bf16", 90.0), (f"pipeline/{model}/bf16", 150.0)]
    if not args.no_daemons:
        phases.append((f"swarm/{first}/bf16", 180.0))
    return phases


def _child(args: argparse.Namespace, phase: str, out: Path, params: Path | None, limit: float):
    steps, warmup = args.steps, args.warmup
    if params is not None:  # the fp32 check: fewer steps, less drift from summation order
        steps, warmup = min(steps, args.fp32_steps), min(warmup, args.fp32_steps // 2)
    argv = [sys.executable, __file__, "--phase", phase, "--out", str(out), "--device",
            args.device, "--steps", str(steps), "--warmup", str(warmup),
            "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size),
            "--micro-batches", str(args.micro_batches), "--threads", str(args.threads),
            "--limit", str(limit)]  # fmt: skip
    if params is not None:
        argv += ["--params-out", str(params)]
    errors = out.with_suffix(".stderr")
    # Its own session: on a timeout the whole group (the launcher's stage processes too) goes.
    with errors.open("w") as stderr:
        process = subprocess.Popen(argv, start_new_session=True, stderr=stderr)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    last = (errors.read_text().strip().splitlines() or ["(nothing on stderr)"])[-1][:500]
    if code is None:
        raise TimeoutError(f"ran past its {limit:.0f}s limit, killed; last said: {last}")
    if code != 0:
        raise RuntimeError(f"exited with code {code}: {last}")
    return json.loads(out.read_text())


def _compare(tmp: Path, model: str, results: dict[str, Any]) -> dict[str, Any]:
    import torch

    local = results.get(f"local/{model}/fp32", {})
    pipe = results.get(f"pipeline/{model}/fp32", {})
    if "losses" not in local or "losses" not in pipe:
        return {"error": "an fp32 phase did not finish"}
    one = torch.load(tmp / f"local-{model}.pt", weights_only=True)
    two = torch.load(tmp / f"pipeline-{model}.pt", weights_only=True)
    if one.keys() != two.keys():
        return {"error": f"parameter names differ: {sorted(one.keys() ^ two.keys())[:4]}"}
    loss_gap = max(abs(a - b) for a, b in zip(local["losses"], pipe["losses"], strict=True))
    param_gap = max(float((one[k] - two[k]).abs().max()) for k in one)
    return {"loss_max_abs": loss_gap, "param_max_abs": param_gap, "atol": _EQUAL_ATOL,
            "equal": loss_gap <= _EQUAL_ATOL and param_gap <= _EQUAL_ATOL}  # fmt: skip


def drive(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "phase"},
                              "phases": {}, "errors": {}}  # fmt: skip
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory(prefix="fusionllm-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        for phase, limit in _phases(args):
            left = deadline - time.monotonic()
            if left < 10:
                report["errors"][phase] = "skipped: the run's time budget is spent"
                say(f"[skip] {phase}: no time left")
                continue
            say(f"[{time.strftime('%H:%M:%S')}] {phase} (limit {min(limit, left):.0f}s)")
            params = None
            if phase.endswith("/fp32"):
                kind, model, _ = phase.split("/")
                params = tmp / f"{kind}-{model}.pt"
            started = time.monotonic()
            try:
                out = _child(args, phase, tmp / "out.json", params, min(limit, left))
                out["wall_s"] = time.monotonic() - started
                report["phases"][phase] = out
                say(f"    done in {out['wall_s']:.1f}s")
            except (TimeoutError, RuntimeError, OSError, ValueError) as exc:
                report["errors"][phase] = str(exc)
                say(f"    FAILED: {exc}")
            _write(args, report)
        report["fp32_equal"] = _compare(tmp, args.models[0], report["phases"])
    _write(args, report)
    return report


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _peak_tflops(args: argparse.Namespace, env: dict[str, Any]) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    name = env.get("name", "")
    for part, peak in _PEAKS:
        if part in name:
            return peak, f"{part} bf16 dense"
    if env.get("matmul_tflops"):
        return env["matmul_tflops"], "measured bf16 matmul"
    return None, "unknown"


def table(report: dict[str, Any]) -> list[str]:
    env = report["phases"].get("env", {})
    peak, source = _peak_tflops(argparse.Namespace(**report["args"]), env)
    lines = [f"device: {env.get('name', '?')} ({env.get('device', '?')}), torch "
             f"{env.get('torch', '?')}, CUDA {env.get('cuda')}, bf16 matmul "
             f"{env.get('matmul_tflops', float('nan')):.0f} TFLOP/s; MFU against "
             f"{peak if peak else float('nan'):.0f} TFLOP/s ({source})",
             f"{'run':<24} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}  "
             "peak memory per process (GiB)"]  # fmt: skip
    for phase, row in report["phases"].items():
        if phase == "env":
            continue
        mfu = f"{100 * row['model_tflops'] / peak:5.1f}%" if peak else "     -"
        memory = " ".join(f"{b / 2**30:.2f}" for b in row["peak_device_bytes"] if b) or "-"
        lines.append(f"{phase:<24} {row['step_s']:>8.3f} {row['tokens_per_s']:>10,.0f} "
                     f"{row['model_tflops']:>8.1f} {mfu:>6}  {memory}")  # fmt: skip
    for phase, error in report["errors"].items():
        lines.append(f"{phase:<24} FAILED: {error}")
    for phase, row in report["phases"].items():
        if row.get("plan_wire") is not None:  # the launcher rows: even cuts, every link dense
            lines.append(f"{phase}: the plan's cuts {row['plan_ranges']}, links {row['plan_wire']}")
    for model in report["args"]["models"]:
        local = report["phases"].get(f"local/{model}/bf16")
        pipe = report["phases"].get(f"pipeline/{model}/bf16")
        if local and pipe:
            ratio = pipe["tokens_per_s"] / local["tokens_per_s"]
            lines.append(f"{model} bf16: 2 processes / one process tokens/s = {ratio:.2f}")
    equal = report.get("fp32_equal", {})
    if "equal" in equal:
        verdict = "EQUAL" if equal["equal"] else "DIFFERENT"
        lines.append(f"fp32 pipeline vs one process: losses max |diff| "
                     f"{equal['loss_max_abs']:.2e}, parameters max |diff| "
                     f"{equal['param_max_abs']:.2e} -> {verdict} at {equal['atol']:g}")  # fmt: skip
    elif equal:
        lines.append(f"fp32 pipeline vs one process: not compared ({equal['error']})")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here (rewritten after every phase)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N (%(default)s)")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["small", "medium"],
        help="GPT-2 presets; the first one also runs fp32 (%(default)s)",
    )
    parser.add_argument("--steps", type=int, default=12, help="per run (%(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=4, help="first steps left out of the medians (%(default)s)"
    )
    parser.add_argument(
        "--fp32-steps",
        type=int,
        default=6,
        help="steps of the fp32 equality check (%(default)s): few, as AdamW turns "
        "summation-order noise in a near-zero gradient into a whole lr-sized step",
    )
    parser.add_argument("--seq-len", type=int, default=1024, help="(%(default)s)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="(%(default)s)")
    parser.add_argument("--micro-batches", type=int, default=8, help="per step (%(default)s)")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads per stage process (%(default)s)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="the device's peak for MFU (default: known GPUs' bf16 dense peak)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=_TOTAL_BUDGET_S,
        help="seconds for all phases together (%(default)s)",
    )
    parser.add_argument(
        "--no-daemons",
        action="store_true",
        help="leave out the fusionllm swarm row (2 real node daemons)",
    )
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, default=600.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--params-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)  # fmt: skip
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be above --warmup ({args.warmup})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        return run_phase(args)
    started = time.monotonic()
    report = drive(args)
    say("")
    for line in table(report):
        say(line)
    say(f"total {time.monotonic() - started:.0f}s")
    equal = report.get("fp32_equal", {}).get("equal")
    return 0 if not report["errors"] and equal else 1


if __name__ == "__main__":
    sys.exit(main())
