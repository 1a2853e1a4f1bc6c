"""The killed-node run of benchmarks/testbed.py: one member of the plan being trained is
SIGKILLed halfway through, and the survivors must re-plan around it and finish the run.

Measured: the recovery time (from the kill to the first step a plan started after it finishes)
and the steps lost (the newest step finished anywhere before a post-kill plan started, minus
that plan's start step: what the survivors trained again, from checkpoint copies).
"""

import signal
import time

from fusionllm.node.local_swarm import first_step_after, rollbacks, serving


class Killer:
    """Kills one serving member once the swarm has finished ``at_step`` steps."""

    def __init__(self, nodes, at_step: int) -> None:
        self.nodes, self.at_step = nodes, at_step
        self.victim = None
        self.killed_at: float | None = None
        self.step_at_kill: int | None = None

    def poll(self, last: int) -> None:
        """Called with the newest step finished; kills once, when it is due."""
        if self.victim is not None or last < self.at_step:
            return
        members = serving(self.nodes)
        # Not the bootstrap node (the others joined through it) when another member serves.
        candidates = [n for n in members if n is not self.nodes[0]] or members
        if not candidates:
            return  # between plans: try at the next poll
        self.victim = candidates[-1]
        self.step_at_kill = last
        self.killed_at = time.time()
        self.victim.kill(signal.SIGKILL)

    def survivors(self) -> list:
        return [n for n in self.nodes if n is not self.victim]

    def report(self) -> dict:
        if self.victim is None:
            return {"killed": None}
        survivors = self.survivors()
        recovered = first_step_after(survivors, self.killed_at)
        lost = rollbacks(survivors, self.killed_at)
        return {
            "killed": self.victim.name,
            "killed_after_step": self.step_at_kill,
            "recovery_s": None if recovered is None else recovered - self.killed_at,
            "steps_lost": max(lost, default=None),
        }
