"""One pipeline process at work: a StageWorker, its 1F1B schedule, frames to and from peers.

Per step a process (stage s, replica r) runs, in order:

0. on a validation step (``--eval-every``), its held-out micro-batches forward only
   (evaluation.py);
1. its schedule: a forward takes the micro-batch from the data (stage 0) or an activation
   frame from stage s - 1, and sends its outgoing link's values to the replica of stage s + 1
   that owns the micro-batch; a backward takes the gradient frame from stage s + 1 (or the
   loss, on the last stage) and sends the input gradients back to stage s - 1;
2. the data-parallel all-reduce inside its fence: every replica sends its flat gradients to the
   others and all sum the R copies in replica order (losses are scaled by 1 / M over the whole
   step's micro-batches, so that sum is the average of the replicas' mean-loss gradients);
3. tied parameters (GPT-2's wte / lm_head): each holder sends its gradient to the other holder
   stages and every holder sums them in stage order, so the copies stay bit-identical;
4. a control all-gather of (squared gradient norm, loss sum, loss count, and the validation's
   sums): every process gets the global norm (a tied parameter counted once, replicas once),
   the step's loss and the validation loss; a
   process whose share does not depend on step 3 (all but the stage counting a tied
   parameter) sends its part before step 3, so the step ends one link latency sooner;
5. ``clip_and_step``.

Why an all-gather over our own transport for steps 2 and 4 rather than hivemind's averager:
the members of a fence and the ranks of the run are fixed by the plan, the step must wait for
the exact sum anyway (synchronous SGD), and the streams to those peers are already open;
hivemind's DecentralizedAverager forms groups by matchmaking over the DHT (asyncio, seconds of
latency, a group may come out partial), which suits asynchronous volunteers, not a lock-step
pipeline that must match a single process to 1e-4. Deterministic summation order makes every
replica compute the same bits.

Frame headers: ``stage`` is always the sender's stage (checked against the sender's peer id);
``micro_batch`` is the micro-batch for activations/gradients and a tag for control frames.
Compression per link and direction, at the config's top-k ratio's bytes: activations as
``activation_codec`` picks (a ternary code of every element while it fits, else top-k; no error
feedback, each micro-batch is new data), gradients as the config's ``gradient_codec`` (top-k, or
the ternary code) with error feedback (link_feedback.py: one residual per link and receiver);
link_codecs.py packs both and counts their bytes.
"""

import itertools
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import FrameTimeoutError, PipelineError, StepAbortedError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received, Transport
from fusionllm.node.pipeline.busy import compute_clock
from fusionllm.node.pipeline.compute import Compute, Staging
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.evaluation import eval_pass
from fusionllm.node.pipeline.exchanges import (
    all_reduce_replicas,
    gather_summary,
    send_summary,
    sum_tied,
    summary_first,
)
from fusionllm.node.pipeline.expectations import Expectations, roles_of
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.link_codecs import LinkCodecs
from fusionllm.node.pipeline.link_feedback import GradientFeedback
from fusionllm.node.pipeline.loss_scale import LossScale, ScaleState
from fusionllm.node.pipeline.mailbox import Mailbox, Role, pump
from fusionllm.node.pipeline.patience import Patience, PatienceConfig
from fusionllm.node.pipeline.schedule import owner, replica_schedule
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.pipeline.steps import PHASES, Sends, StepReport
from fusionllm.node.pipeline.summary import Summary
from fusionllm.node.pipeline.traffic import LinkTraffic
from fusionllm.node.pipeline.train_config import TrainConfig, weight_source

logger = get_logger(__name__)

# Forwards a stage runs ahead of plain 1F1B (schedule.one_f_one_b's slack): a frame's fixed
# cost (~1-3 ms here) would otherwise stall every steady-state backward for a round trip to the
# next stage; one more micro-batch in flight hides it. Measured (2 stages, GPT-2 tiny, 2 cores):
# see benchmarks/pipeline.py. One more activation per stage is the memory it costs.
_WARMUP_SLACK = 1
_CHECK_S = 1.0  # how often a wait for a frame looks at our own failed sends


def _phases(marks: list[float]) -> dict[str, float]:
    """StepReport.phases from the clock read between them."""
    return {name: b - a for name, (a, b) in zip(PHASES, itertools.pairwise(marks), strict=True)}


def _compute_for(config: TrainConfig, compute: Compute | None) -> Compute:
    """Where and how this process computes: the run's precision, on the CPU by default."""
    chosen = compute if compute is not None else Compute(precision=config.precision)
    if chosen.precision != config.precision:
        raise PipelineError(
            f"the run computes in {config.precision}, this process in {chosen.precision}"
        )
    return chosen


def _checked_under_report(factor: float) -> float:
    """The test hook's factor: a liar that says it computed 1 to 1000 times faster."""
    if not 1.0 <= factor <= 1e3:
        raise PipelineError(f"fault_under_report {factor} is not in [1, 1000]")
    return factor


class PipelineRunner:
    """Drives one process's part of every step; the transport must already be started."""

    def __init__(
        self,
        *,
        config: TrainConfig,
        layout: PipelineLayout,
        role: Role,
        dataset: TokenDataset,
        transport: Transport,
        peers: dict[Role, str],  # every other process's peer id
        timeout_s: float = 60.0,
        vote: Callable[[], float] = lambda: 0.0,
        own_pump: bool = True,
        compute: Compute | None = None,
        deferred: bool = False,
        fault_under_report: float = 1.0,  # test hook: say we computed this many times faster
    ) -> None:
        """``vote`` is sent with every step's summary, so every process ends the step knowing
        every other's (a node votes for the plan it would run next: a unanimous vote switches
        plans at that step boundary on every process alike). ``own_pump=False``: the caller
        feeds ``mailbox`` itself (a node whose transport outlives this runner). ``compute``:
        where this process's stage runs and in what precision (default: CPU, float32); frames
        always travel from and to host memory, staged through pinned buffers on a GPU.
        ``deferred``: the stage stays on meta until ``worker.make_real`` (StageWorker)."""
        self.config = config
        self.layout = layout
        self.role = role
        self.dataset = dataset
        self.transport = transport
        self.timeout_s = timeout_s
        # A frame's wait: the step's measured rhythm, at most ``timeout_s`` (patience.py).
        floor = min(PatienceConfig.floor_s, timeout_s)
        self.patience = Patience(PatienceConfig(cap_s=timeout_s, floor_s=floor))
        self._vote = vote
        self.completed_steps: int | None = None  # the step after the last one applied
        self.roles = roles_of(config)
        self.peer_of = dict(peers)
        self._check_peers()
        self.rank = self.roles.index(role)
        self.compute = _compute_for(config, compute)
        self.worker = self._new_worker(deferred)
        self.staging = Staging(self.compute)
        self._clock = compute_clock(self.compute)  # busy_s: kernel time on a GPU (busy.py)
        self._under_report = _checked_under_report(fault_under_report)
        self.loss_scale = LossScale() if self.compute.precision == "fp16" else None
        self._overflow = False  # this step's, so far (fp16)
        self.replicas = config.stage_replicas
        self.tied_names = sorted(n for n, h in layout.tied.items() if role.stage in h)
        self.tied_index = {name: i for i, name in enumerate(sorted(layout.tied))}
        self._feedback = GradientFeedback()
        self.traffic = LinkTraffic()  # bytes per link this step (the StepReport's links)
        self.codecs = LinkCodecs(
            config=config, staging=self.staging, feedback=self._feedback, traffic=self.traffic
        )
        self._compute_cpu_s = 0.0  # this step's, so far (StepReport.busy_cpu_s)
        self._summary_first = summary_first(role, self.tied_names, layout)
        self.expectations = Expectations(config, layout, role)
        self.mailbox = self._new_mailbox()
        self._stop = threading.Event()
        self._pump = self._pump_thread() if own_pump else None

    def _check_peers(self) -> None:
        if self.role not in self.roles:
            raise PipelineError(f"{self.role} is not part of this run")
        missing = [r for r in self.roles if r != self.role and r not in self.peer_of]
        if missing:
            raise PipelineError(f"no peer id for {missing}")

    def _new_worker(self, deferred: bool) -> StageWorker:
        config = self.config
        return StageWorker(
            self.layout,
            self.role.stage,
            optimizer=config.optimizer,
            micro_batches=config.micro_batches,
            compute=self.compute,
            weights=weight_source(config),
            deferred=deferred,
        )

    def _new_mailbox(self) -> Mailbox:
        frames_per_step = 2 * self.config.micro_batches + len(self.roles) + len(self.layout.tied)
        return Mailbox(
            ranks={self.peer_of[r]: self.roles.index(r) for r in self.roles if r != self.role},
            admit=self.expectations.admit,
            # 4 steps' frames, validation activations (M) included
            max_frames=4 * frames_per_step + 16,
        )

    def _pump_thread(self) -> threading.Thread:
        return threading.Thread(
            target=pump,
            args=(self.transport, self.mailbox, self._stop),
            name="pipeline-recv",
            daemon=True,
        )

    # ----- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._pump is not None:
            # Frames go straight from the transport's thread into the mailbox; the pump is
            # left with what came before this and with the transport's end.
            self.transport.deliver_to(self._file)
            self._pump.start()

    def close(self) -> None:
        self._stop.set()
        if self._pump is not None:
            self.transport.deliver_to(None)
            if self._pump.is_alive():
                self._pump.join(2.0)

    def _file(self, item: Received) -> bool:
        self.mailbox.put(item)
        return True

    def abort(self, reason: BaseException) -> None:
        """Make a step blocked on a frame fail now (a peer is gone, the node stops)."""
        self.mailbox.close(reason)

    def residuals(self) -> dict[str, torch.Tensor]:
        """Error-feedback residuals by link and receiver, in true gradient units."""
        return self._feedback.table(self._scale())

    def load_residuals(self, table: dict[str, torch.Tensor]) -> None:
        """Take ``residuals()`` back (same plan only: keys name this plan's links and peers);
        ValueError, nothing loaded, for a residual this stage would not hold."""
        s = self.role.stage
        expected = {
            f"gradient/{s - 1}/{s - 1}.{r}": self.layout.links[s - 1].numel
            for r in range(self.replicas[s - 1] if s else 0)
        }
        self._feedback.load(table, self._scale(), expected)

    def scale_state(self) -> ScaleState | None:
        """fp16's loss scale between steps (None in fp32/bf16): checkpoints and copies keep it."""
        return self.loss_scale.state() if self.loss_scale is not None else None

    def restore_scale(self, state: ScaleState) -> None:
        """Continue from the loss scale of the step this plan resumes at (every member alike);
        live residuals follow it (they carry the scale). A no-op without fp16."""
        if self.loss_scale is not None:
            before = self.loss_scale.scale
            self.loss_scale.restore(state)
            self._feedback.rescale(before, state.scale)

    def _scale(self) -> float:
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    # ----- one step ---------------------------------------------------------------------------

    def run_step(self, step: int) -> StepReport:
        started, started_cpu = time.perf_counter(), time.thread_time()
        self.patience.step_started(step, time.monotonic())
        self.mailbox.advance(step)
        sends = Sends()
        self._compute_cpu_s = 0.0
        self._overflow = False
        scale = self._scale()
        self.worker.loss_scale = scale
        eval_sum, eval_count = eval_pass(self, step, sends)  # before the step changes anything
        losses, busy, (wait_in, wait_out), order = self._schedule(step, sends)
        if self.loss_scale is not None:  # before any gradient leaves: they must be finite
            self._overflow |= self.worker.unscale_or_zero(scale)
        marks = [time.perf_counter()]
        all_reduce_replicas(self, step, sends)
        mine = Summary(0.0, sum(float(x) for x in losses), len(losses), 0.0, self._overflow,
                       eval_sum, eval_count, busy, wait_in, wait_out)  # fmt: skip
        if self._summary_first:
            mine = send_summary(self, step, sends, mine)
        sum_tied(self, step, sends)
        if not self._summary_first:
            mine = send_summary(self, step, sends, mine)
        marks.append(time.perf_counter())
        totals = gather_summary(self, step, sends, mine)  # checks the counts: never half-apply
        marks.append(time.perf_counter())
        norm = math.sqrt(totals.sq)
        if totals.overflow:  # some stage's gradients overflowed: every stage skips the step
            self.worker.skip_step()
        else:
            self.worker.clip_and_step(norm)
        if self.loss_scale is not None:
            self.loss_scale.update(totals.overflow)
            self._feedback.rescale(scale, self.loss_scale.scale)
        self.completed_steps = step + 1  # from here on the step counts, even if a send fails
        marks.append(time.perf_counter())
        sends.wait(self.timeout_s)
        marks.append(time.perf_counter())
        return StepReport(
            step=step,
            loss=totals.loss_sum / totals.loss_count,
            grad_norm=norm,
            seconds=time.perf_counter() - started,
            busy_s=busy,
            wait_s=wait_in + wait_out,
            busy_cpu_s=self._compute_cpu_s,
            step_cpu_s=time.thread_time() - started_cpu,
            votes=totals.votes,
            peak_device_bytes=self.compute.peak_memory_bytes(),
            skipped=totals.overflow,
            loss_scale=scale,
            samples=self._samples_read(step, order),
            eval_loss=totals.eval_sum / totals.eval_count if totals.eval_count else None,
            links=self.traffic.take(),
            timings=totals.timings,
            phases=_phases(marks),
        )

    def _samples_read(self, step: int, order: list[tuple[str, int]]) -> tuple[int, ...]:
        if not self.worker.is_first:
            return ()
        config, owned = self.config.batch, [mb for kind, mb in order if kind == "F"]
        return tuple(w for mb in owned for w in self.dataset.samples(config, step, mb))

    def _schedule(
        self, step: int, sends: Sends
    ) -> tuple[list[torch.Tensor], float, tuple[float, float], list[tuple[str, int]]]:
        """This process's 1F1B forwards and backwards of ``step``: (the losses, on the device
        until the summary: no sync before; compute seconds; seconds waiting for activations
        and for gradients; the schedule run)."""
        s = self.role.stage
        order = replica_schedule(
            s,
            len(self.replicas),
            self.config.micro_batches,
            self.replicas[s],
            self.role.replica,
            slack=_WARMUP_SLACK,
        )
        losses: list[torch.Tensor] = []
        busy, wait_in, wait_out = 0.0, 0.0, 0.0
        for kind, mb in order:
            if kind == "F":
                computed, waited, loss = self._forward(step, mb, sends)
                wait_in += waited
                if loss is not None:
                    losses.append(loss)
            else:
                computed, waited = self._backward(step, mb, sends)
                wait_out += waited
            busy += computed
        busy = self._clock.settle(busy) / self._under_report  # a liar's word (test hook)
        return losses, busy, (wait_in, wait_out), order

    def _forward(
        self, step: int, mb: int, sends: Sends
    ) -> tuple[float, float, torch.Tensor | None]:
        """Micro-batch ``mb`` forward: its input from the data or stage s - 1, its output to
        stage s + 1. (compute seconds, seconds waiting for the input, the loss on the last
        stage or None)."""
        s, worker = self.role.stage, self.worker
        t0 = time.perf_counter()
        if worker.is_first:
            inputs = {"idx": self.dataset.batch(self.config.batch, step, mb)[0]}
        else:
            flat = self.take(
                FrameKind.ACTIVATION,
                step,
                mb,
                Role(s - 1, owner(mb, self.replicas[s - 1])),
                sends,
            )
            flat = self.staging.to_device(("activation", s - 1), flat)
            inputs = self.layout.links[s - 1].unpack(flat)
        targets = self.dataset.batch(self.config.batch, step, mb)[1] if worker.is_last else None
        t1, cpu, mark = time.perf_counter(), time.thread_time(), self._clock.start()
        out = worker.forward(step, mb, inputs, targets)
        computed = self._clock.stop(mark)
        self._compute_cpu_s += time.thread_time() - cpu
        if worker.is_last:
            return computed, t1 - t0, out["loss"]
        target = Role(s + 1, owner(mb, self.replicas[s + 1]))
        # Codecs run on the host, as on a CPU node: the same bits whatever the device, and
        # the error-feedback residuals stay in host memory (checkpoints save them).
        flat = self.staging.to_host(("activation", s), self.layout.links[s].pack(out))
        body = self.activation_body(s, flat)
        sends.futures.append(self.send(target, FrameKind.ACTIVATION, step, mb, body))
        return computed, t1 - t0, None

    def activation_body(self, link: int, flat: torch.Tensor) -> bytes:
        """An activation frame of ``link`` from its host values, in the plan's code for it."""
        return self.codecs.activation(link, flat)

    def _backward(self, step: int, mb: int, sends: Sends) -> tuple[float, float]:
        """Micro-batch ``mb`` backward: the output gradient from stage s + 1 (none on the last
        stage: the loss), the input gradients to stage s - 1. (compute seconds, seconds
        waiting for the gradient)."""
        s, worker = self.role.stage, self.worker
        t0 = time.perf_counter()
        grads = None
        if not worker.is_last:
            flat = self.take(
                FrameKind.GRADIENT,
                step,
                mb,
                Role(s + 1, owner(mb, self.replicas[s + 1])),
                sends,
            )
            flat = self.staging.to_device(("gradient", s), flat)
            grads = self.layout.links[s].unpack(flat)
        t1, cpu, mark = time.perf_counter(), time.thread_time(), self._clock.start()
        input_grads = worker.backward(step, mb, grads)
        computed = self._clock.stop(mark)
        self._compute_cpu_s += time.thread_time() - cpu
        if not worker.is_first:
            target = Role(s - 1, owner(mb, self.replicas[s - 1]))
            flat = self.staging.to_host(
                ("gradient", s - 1), self.layout.links[s - 1].pack(input_grads)
            )
            if self.loss_scale is not None and not bool(torch.isfinite(flat).all()):
                # fp16 overflow: peers refuse non-finite frames, so send zeros; our summary
                # tells everyone to skip the step.
                self._overflow, flat = True, torch.zeros_like(flat)
            body = self._pack_gradient(s - 1, target, flat)
            sends.futures.append(self.send(target, FrameKind.GRADIENT, step, mb, body))
        return computed, t1 - t0

    # ----- frames -----------------------------------------------------------------------------

    def _pack_gradient(self, link: int, target: Role, flat: torch.Tensor) -> bytes:
        return self.codecs.gradient(link, target, flat)

    def send(self, target: Role, kind: FrameKind, step: int, tag: int, body: bytes) -> Future:
        header = FrameHeader(step=step, micro_batch=tag, kind=kind, stage=self.role.stage)
        return self.transport.send_async(self.peer_of[target], header, body, timeout=self.timeout_s)

    def take(
        self, kind: FrameKind, step: int, tag: int, sender: Role, sends: Sends
    ) -> torch.Tensor:
        key = (kind.value, step, tag, self.roles.index(sender))
        header = FrameHeader(step=step, micro_batch=tag, kind=kind, stage=sender.stage)
        patience = self.patience.wait_s(self.expectations.frame_bytes(header))
        deadline = time.monotonic() + patience
        while True:
            sends.check()
            left = deadline - time.monotonic()
            try:
                return self.mailbox.take(key, timeout=min(max(left, 0.0), _CHECK_S))
            except StepAbortedError:
                raise
            except PipelineError:
                if left <= _CHECK_S:
                    raise FrameTimeoutError(
                        f"{self.role}: {kind.value} frame (step {step}, tag {tag}) from {sender} "
                        f"did not arrive within {patience:.1f}s",
                        rank=key[3],
                        step=step,
                    ) from None
