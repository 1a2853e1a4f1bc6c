"""One node's Prometheus metrics, in a registry of its own, fed by the node's events.

The node already says what happens as events (the daemon's ``epoch``, the trainer's ``step``,
``train_plan``, ``checkpoint``, ``saved``): ``NodeMetrics.on_event`` turns them into metrics as
they pass to the printer, so nothing in the training loop knows about Prometheus. What is
counted elsewhere (refusals, DHT rounds, the checkpoint's age) is read at scrape time
(pulled.py). A registry per node, not prometheus-client's global one: tests run several nodes'
metrics in one process.
"""

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from fusionllm.common.logs import get_logger
from fusionllm.node.observe.pulled import PulledCollector, Sources

logger = get_logger(__name__)

# Step times from a fast CPU test swarm (~0.05 s) to a GPT-2 step over slow home links (minutes).
_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)
_LINK = ("link", "kind")  # link k joins stage k and k + 1; kind: activation or gradient


class NodeMetrics:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.step = Gauge("fusionllm_step", "the newest step this node trained", registry=r)
        self.steps = Counter("fusionllm_steps", "steps this node trained", registry=r)
        self.loss = Gauge("fusionllm_loss", "the newest step's training loss", registry=r)
        self.eval_loss = Gauge("fusionllm_eval_loss", "the newest validation loss", registry=r)
        self.tokens = Gauge(
            "fusionllm_tokens_per_second", "the newest step's tokens per second", registry=r
        )
        self.step_time = Histogram(
            "fusionllm_step_seconds", "wall time of a step", buckets=_STEP_BUCKETS, registry=r
        )
        self.dense = Counter(
            "fusionllm_link_dense_bytes", "bytes sent per link before compression", _LINK,
            registry=r,
        )  # fmt: skip
        self.wire = Counter(
            "fusionllm_link_wire_bytes", "bytes sent per link after compression", _LINK,
            registry=r,
        )  # fmt: skip
        self.codec = Info("fusionllm_link_codec", "the codec of a link's last frame", _LINK,
                          registry=r)  # fmt: skip
        self.members = Gauge("fusionllm_members", "members of the swarm this node sees", registry=r)
        self.serving = Gauge("fusionllm_plan_peers", "peers the adopted plan seats", registry=r)
        self.backup = Gauge("fusionllm_backup_peers", "members the plan leaves in backup",
                            registry=r)  # fmt: skip
        self.stages = Gauge("fusionllm_plan_stages", "stages of the adopted plan", registry=r)
        self.epoch = Gauge("fusionllm_plan_epoch", "the adopted plan's epoch", registry=r)
        self.plan = Info("fusionllm_plan", "the adopted plan: epoch, digest", registry=r)
        self.stage = Gauge("fusionllm_stage", "the stage this node serves (-1: none)", registry=r)
        self.stage.set(-1)
        for unknown in (self.loss, self.eval_loss, self.tokens):
            unknown.set(float("nan"))  # not 0: a scrape before the first step shows no value
        self.pulled = PulledCollector(clock=clock)
        r.register(self.pulled)

    def attach(self, sources: Sources) -> None:
        """Read these at scrape time from now on (the node's parts, once they run)."""
        self.pulled.sources = sources

    def on_event(self, event: dict[str, Any]) -> None:
        """One node event; events the metrics do not show pass by. Never raises: a metric
        that cannot be updated must not take the node's event printer down."""
        handler = _HANDLERS.get(event.get("event"))
        if handler is None:
            return
        try:
            handler(self, event)
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("metrics: could not read a %s event: %r", event["event"], exc)

    def chain(self, on_event: Callable[[dict], None]) -> Callable[[dict], None]:
        """``on_event`` that updates the metrics first."""

        def both(event: dict) -> None:
            self.on_event(event)
            on_event(event)

        return both

    def _on_step(self, event: dict) -> None:
        # Every field read before any metric moves: a malformed event changes nothing.
        step, seconds = int(event["step"]), float(event["seconds"])
        tokens_per_s = float(event["tokens_per_s"])
        loss, held_out = event.get("loss"), event.get("eval_loss")
        links = [
            ((str(t["link"]), str(t["kind"])), int(t["dense_bytes"]), int(t["wire_bytes"]),
             str(t["codec"]))
            for t in event.get("links") or ()
        ]  # fmt: skip
        self.step.set(step)
        self.steps.inc()
        if loss is not None:
            self.loss.set(loss)
        if held_out is not None:
            self.eval_loss.set(held_out)
        self.tokens.set(tokens_per_s)
        self.step_time.observe(seconds)
        for labels, dense, wire, codec in links:
            self.dense.labels(*labels).inc(dense)
            self.wire.labels(*labels).inc(wire)
            self.codec.labels(*labels).info({"codec": codec})

    def _on_epoch(self, event: dict) -> None:
        self.members.set(len(event["members"]))
        self.serving.set(sum(len(s) for s in event["stages"]))
        self.backup.set(len(event["backup"]))
        self.stages.set(len(event["stages"]))
        self.epoch.set(event["epoch"])
        self.plan.info({"epoch": str(event["epoch"]), "digest": str(event["digest"])})

    def _on_train_plan(self, event: dict) -> None:
        self.stage.set(event["stage"] if event.get("stage") is not None else -1)

    def _on_plan_end(self, event: dict) -> None:
        self.stage.set(-1)

    def _on_checkpoint(self, event: dict) -> None:
        self.pulled.checkpointed(step=event["step"])


_HANDLERS: dict[str, Callable[[NodeMetrics, dict], None]] = {
    "step": NodeMetrics._on_step,
    "epoch": NodeMetrics._on_epoch,
    "train_plan": NodeMetrics._on_train_plan,
    "plan_end": NodeMetrics._on_plan_end,
    "checkpoint": NodeMetrics._on_checkpoint,
    "saved": NodeMetrics._on_checkpoint,
}
