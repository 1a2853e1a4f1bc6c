"""What a trainer writes down: its events (one JSON object a line, read by `fusionllm swarm`,
benchmarks and tests) and its stage's parameters when the run ends."""

import io
import time
from pathlib import Path

import torch

from fusionllm.common.atomic import write_atomic
from fusionllm.node.pipeline.runner import StepReport
from fusionllm.node.training.assignment import Assignment
from fusionllm.node.training.session_terms import Held

# TrainConfig's per-link codec fields, as a plan sets them (assignment.assign)
WIRE_FIELDS = ("activation_ratios", "gradient_ratios", "activation_halves", "gradient_halves")


def step_event(report: StepReport, tokens_per_step: int, bytes_out: int) -> dict:
    return {"event": "step", "step": report.step, "loss": report.loss, "t": time.time(),
            "grad_norm": report.grad_norm, "seconds": report.seconds,
            "tokens_per_s": tokens_per_step / max(report.seconds, 1e-9),
            "busy_s": report.busy_s, "wait_s": report.wait_s, **report.phases,
            "busy_cpu_s": report.busy_cpu_s, "step_cpu_s": report.step_cpu_s,
            "samples": list(report.samples), "eval_loss": report.eval_loss,
            "bytes_out": bytes_out,
            "links": [t.to_json() for t in report.links],
            "peak_device_bytes": report.peak_device_bytes,
            "skipped": report.skipped, "loss_scale": report.loss_scale}  # fmt: skip


def plan_event(plan_of: Assignment, start: int, moved: tuple[int, int]) -> dict:
    wire = plan_of.config  # the links' codecs: a benchmark reruns the plan on equal terms
    return {"event": "train_plan", "digest": plan_of.digest, "start_step": start,
            "t": time.time(),
            "sent": moved[0], "received": moved[1],
            "stage": plan_of.role.stage, "replica": plan_of.role.replica,
            "ranges": [list(r) for r in plan_of.ranges],
            "wire": {name: list(getattr(wire, name)) for name in WIRE_FIELDS},
            "stages": [[plan_of.peers[r] for r in sorted(plan_of.peers)
                        if r.stage == s] for s in range(len(plan_of.ranges))]}  # fmt: skip


def save_final_params(path: Path, held: Held) -> None:
    """This node's stage as the run ended it, with where it sits in the plan."""
    role = held.assignment.role
    buffer = io.BytesIO()
    torch.save(
        {
            "params": held.worker.state_dict(),
            "stage": role.stage if role else None,
            "replica": role.replica if role else None,
            "nodes": list(held.layout.stages[role.stage]) if role else [],
            "step": held.next_step,
            "plan": held.assignment.digest,
        },
        buffer,
    )
    write_atomic(path, buffer.getvalue())
