"""What one pipeline step reports, and the sends it waits for before it ends."""

from concurrent.futures import Future
from dataclasses import dataclass, field

from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.traffic import LinkTally

# StepReport.phases' names, in the order the runner reads its clock between them
PHASES = ("exchange_s", "summary_wait_s", "update_s", "sends_s")


@dataclass
class StepReport:
    step: int
    loss: float
    grad_norm: float
    seconds: float  # wall time of the whole step
    busy_s: float  # forward + backward compute of this process
    wait_s: float  # blocked on frames during the schedule
    # The CPU time of that compute (this thread's): below busy_s where the process shared its
    # core (busy_s then counts the other's turns too), above where compute itself got slower.
    busy_cpu_s: float = 0.0
    # This thread's CPU time over the whole step: what it spent beside its compute (framing,
    # data, the schedule's bookkeeping, the update) is step_cpu_s - busy_cpu_s, which a
    # host short of CPU pays in step time too.
    step_cpu_s: float = 0.0
    votes: tuple[float, ...] = ()  # every process's plan vote, in rank order
    peak_device_bytes: int = 0  # this process's GPU memory high-water mark so far (0: a CPU)
    skipped: bool = False  # fp16: a gradient overflowed somewhere; no stage stepped
    loss_scale: float = 1.0  # fp16: the step's loss scale (loss_scale.py)
    # The windows (sample ids) this process fed as inputs, on the first stage (else empty):
    # what a test or a log reads to see that no sample is repeated or skipped.
    samples: tuple[int, ...] = ()
    eval_loss: float | None = None  # held-out loss before this step (evaluation.py), if run
    links: tuple[LinkTally, ...] = ()  # what this process sent on each link this step
    # Every process's (compute s, activation wait s, gradient wait s), in rank order, from the
    # step's summaries (summary.py): what the members witness of each other's pace.
    timings: tuple[tuple[float, float, float], ...] = ()
    # Wall seconds of the step's phases after the schedule (runner.run_step): the exchanges
    # (replicas, tied sums, own summary out), the wait for the others' summaries, the
    # optimizer update, and the wait for this step's sends. Where a step's time goes that
    # the planner's model of compute and frames does not see (issue 25's estimate misses).
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def own_s(self) -> float:
        """Wall seconds of the step that were this process's own work: the step less its waits
        for frames, for the others' summaries and its own sends, and the exchanges (network
        time the planner models apart). What control/stretch.py reads against the model."""
        network = ("exchange_s", "summary_wait_s", "sends_s")
        return max(0.0, self.seconds - self.wait_s - sum(self.phases.get(k, 0.0) for k in network))


@dataclass
class Sends:
    futures: list[Future] = field(default_factory=list)

    def check(self) -> None:
        """Raise the error of a send that already failed (the root cause of a missing reply)."""
        for future in self.futures:
            if future.done() and future.exception() is not None:
                raise PipelineError(f"a send failed: {future.exception()!r}")

    def wait(self, timeout: float) -> None:
        for future in self.futures:
            future.result(timeout)
        self.futures.clear()
