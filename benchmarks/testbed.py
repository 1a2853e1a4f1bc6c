"""The FusionLLM experiment on real daemons: four planning methods on emulated WAN topologies.

    sudo python -m benchmarks.testbed [--topology A|B|C|mini ...] [--quick] [--steps N]
                                      [--json PATH] [--plots DIR]

For each topology (fusionllm.testbed) and each method — naive (even layer split in peer-id
order, dense), balanced (cuts by measured compute, links ignored, dense), OP-Fence dense
(``--dense``) and OP-Fence + AdaTopK — one run of real ``fusionllm node`` daemons, one per
host, with the same model, data and seed, ``--steps`` steps to the end (80: a fast plan's
first steps measure the nodes' stretch, control/stretch.py, and an epoch or two after that
the planner's estimate has it; 40 steps of a 0.1 s plan ended first). Each host advertises
the device this machine measured for one torch thread, scaled by the host's CPU quota, so the
planner sees the compute the cgroups really give. Measured per run: step time (median after
a warm-up) and tokens/s, the loss after the fixed steps, bytes on each emulated link per step
(the emulator's counters: everything the hosts sent, control traffic included), the plan
trained longest with its estimated step time (the latest, and as first proposed), how many
plans ran, and the links the nodes
measured (``fusionllm status --watch``, read at the halfway step) beside the configured caps.
``--quick``: topology ``mini`` (3 hosts), naive and OP-Fence + AdaTopK, 30 steps (the
`testbed` test runs it).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.testbed_kill import Killer
from benchmarks.testbed_report import print_tables, write_plots
from benchmarks.testbed_status import StatusWatch
from benchmarks.testbed_swarm import _links
from fusionllm.node.control.probe import measure_device
from fusionllm.node.local_swarm import FAST, LocalSwarm, trained_steps, wait_for
from fusionllm.node.pipeline.steps import PHASES
from fusionllm.testbed import cgroups
from fusionllm.testbed.bed import Testbed, unavailable
from fusionllm.testbed.topology import Topology, load_topology

METHODS = {
    "naive": {"planner": "naive"},
    "balanced": {"planner": "balanced"},
    "opfence-dense": {"dense": True},
    "opfence": {},
}
# The same run everywhere: GPT-2 tiny on the stdlib bytes, 4 micro-batches of 8 x 64 tokens
# (128 KiB of activations per micro-batch and cut: a home link's worth of work). Two stages
# at least, as in the papers' setting (a model no single device holds): tiny fits one host,
# and OP-Fence then trains it on one host alone (measured on mini: 3.9x naive).
RUN = {"seq-len": 64, "micro-batch-size": 8, "micro-batches": 4, "lr": 3e-3, "seed": 0,
       "threads": 1, "step-timeout": 120, "min-stages": 2}  # fmt: skip
TOKENS_PER_STEP = 64 * 8 * 4
TIMING = {**FAST, "heartbeat": 2.0, "ttl": 10.0, "epoch": 4.0, "probe-kib": 1024}
REHEARSE_S = 1.5  # a node's own default (rehearsal.py): FAST turns it off for the tests' swarms
QUICK = {"topologies": ["mini"], "methods": ["naive", "opfence"], "steps": 30}
KILLED = "opfence-kill"  # OP-Fence + AdaTopK with a member SIGKILLed halfway
KILL_CHECKPOINTS = 5  # steps between checkpoints in the killed run


def host_devices(topology: Topology) -> dict[str, dict]:
    """Per host: one torch thread's device as measured here, scaled by the host's CPU quota."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = measure_device("cpu")
    finally:
        torch.set_num_threads(threads)
    devices = {}
    for host in topology.hosts:
        share = min(host.cpu or 1.0, 1.0)
        devices[host.name] = {
            "name": f"cpu-x{share:g}", "kind": "cpu", "memory_bytes": 4 << 30,
            "flops": m.flops * share, "memory_bandwidth": m.memory_bandwidth * share,
            "op_overhead": m.op_overhead / share, "cpu_cores": 1, "ram_bytes": 8 << 30,
            "frame_overhead": m.frame_overhead / share,
            "topk_frame_overhead": m.topk_frame_overhead / share,
            "topk_byte_cost": m.topk_byte_cost / share,
        }  # fmt: skip
    return devices


def _merged_steps(nodes) -> dict[int, dict]:
    """step -> {t: when its last stage reported it, loss, bytes_out per node}."""
    steps: dict[int, dict] = {}
    for node in nodes:
        for e in node.snapshot():
            if e["event"] != "step":
                continue
            s = steps.setdefault(e["step"], {"t": e["t"], "loss": e["loss"]})
            s["t"] = max(s["t"], e["t"])
    return steps


class _Watch:
    """What a run samples while it goes: the emulator's counters at the warm-up's end and at
    the last step, and the swarm as ``fusionllm status`` reads it at the halfway step (a
    watcher started with the run: a one-off call took longer than a fast run's second half)."""

    def __init__(self, bed: Testbed, nodes, warmup: int, steps: int, killer=None) -> None:
        self.bed, self.nodes, self.warmup, self.steps = bed, nodes, warmup, steps
        self.killer = killer
        self.counters: dict[int, dict] = {}
        self.cpu: dict[int, dict[str, cgroups.CpuUsage]] = {}  # at the same marks, per host
        self.main: dict[int, dict[str, float | None]] = {}  # ... each node's main thread
        self.status: dict = {}
        self.status_start: dict = {}
        # the bootstrap node: never killed
        self._status = StatusWatch(bed, bed.hosts[0], nodes[0].dht_addr)

    def poll(self) -> bool:
        """Sample what is due; True once every node has exited."""
        done = _merged_steps(self.nodes)
        last = max(done, default=-1)
        for mark in (self.warmup, self.steps - 1):
            if last >= mark and mark not in self.counters:
                self.counters[mark] = {"step": last, **self.bed.emulator_stats()["fifos"]}
                self.cpu[mark] = {h: cgroups.usage(self.bed.cgroup(h)) for h in self.bed.hosts}
                self.main[mark] = {n.name: main_thread_cpu_s(n.process.pid) for n in self.nodes}
        if self.killer is not None:
            self.killer.poll(last)
        return all(not n.alive() for n in self.nodes)

    def join(self) -> None:
        self._status.close()
        self.status = self._status.reading(self.steps // 2)
        # As training began: links measured before any frame shared an uplink with them.
        self.status_start = self._status.reading(0)


def run_method(
    bed: Testbed, root: Path, method: str, steps: int, devices: dict, *,
    rehearse_s: float = REHEARSE_S,
) -> dict:  # fmt: skip
    """One swarm of the method on ``bed``, ``steps`` steps to the end (``KILLED``: OP-Fence +
    AdaTopK with one member SIGKILLed halfway, the others finishing without it)."""
    (root / method).mkdir(parents=True, exist_ok=True)
    # Every run starts on the whole swarm: nobody trains alone while the others join; the
    # killed run's survivors must be allowed to plan without the one killed.
    # checkpoints (and their copies on the next stage) only there: the survivors resume from
    # the newest copy, and the other methods' figures carry no checkpoint cost.
    flags = METHODS.get(method, {"checkpoint-every": KILL_CHECKPOINTS})
    peers = len(bed.hosts) - (method == KILLED)
    extra = {**TIMING, **RUN, **flags, "steps": steps, "min-peers": peers,
             "rehearse-s": rehearse_s}  # fmt: skip
    swarm = LocalSwarm(root / method, extra=extra)
    warmup = max(3, steps // 5)
    launched, watch = time.time(), None
    try:
        nodes = _start(swarm, bed, devices)
        ready_at = time.time()
        killer = Killer(nodes, steps // 2) if method == KILLED else None
        watch = _Watch(bed, nodes, warmup, steps, killer)
        deadline = time.monotonic() + 60 + 20 * steps + (180 if killer else 0)
        while not watch.poll():
            crashed = [n.name for n in nodes if not n.alive() and n.process.returncode != 0
                       and (killer is None or n is not killer.victim)]  # fmt: skip
            if crashed:  # the rest would wait for it (--min-peers) until the deadline
                raise AssertionError(f"{method}: {crashed} exited with an error")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method}: {steps} steps not done in time:\n{swarm.logs()}")
            time.sleep(0.5)
    finally:
        if watch is not None:
            watch.join()
        swarm.close()
    hosts = {n.peer_id: n.name for n in nodes}
    return {
        "method": method, "steps": steps, "ready_s": ready_at - launched,
        **_timing(_merged_steps(nodes), warmup, steps),
        **_plans(nodes, hosts),
        **_stage_seconds(nodes, warmup),
        "wire": _wire(watch.counters, warmup, steps),
        "host_cpu": _host_cpu(watch.cpu, watch.counters, warmup, steps, watch.main),
        "links": _links(watch.status, hosts, bed.topology),
        "links_start": _links(watch.status_start, hosts, bed.topology),
        "links_start_step": watch.status_start.get("step"),
        "status_s": {"call": watch.status.get("call_s"), **watch.status.get("timing", {}),
                     "readings": watch.status.get("readings"), "step": watch.status.get("step")},
        "status_error": watch.status.get("error"),
        "exit_codes": {n.name: n.process.returncode for n in nodes},
        # every host's steps: one left in backup by a view difference shows as 0
        "node_steps": {n.name: len(trained_steps(n)) for n in nodes},
        # the stretch each node started from (rehearsal.py; None: no rehearsal)
        "rehearsed": {n.name: (n.last("ready") or {}).get("rehearsed") for n in nodes},
        **(killer.report() if killer else {}),
    }  # fmt: skip


def _start(swarm: LocalSwarm, bed: Testbed, devices: dict) -> list:
    def start(name: str, bootstrap: str | None = None):
        extra, prefix = {"host": bed.address(name)}, bed.command(name, [])
        return swarm.start(name, bootstrap=bootstrap, device=devices[name], extra=extra,
                           prefix=prefix)  # fmt: skip

    first = start(bed.hosts[0])
    wait_for(lambda: first.last("ready"), 120, "the first node to be ready")
    nodes = [first, *(start(h, first.dht_addr) for h in bed.hosts[1:])]
    wait_for(lambda: all(n.last("ready") for n in nodes), 180, "every node to be ready")
    return nodes


def _timing(steps: dict[int, dict], warmup: int, total: int) -> dict:
    if sorted(steps) != list(range(total)):
        return {"error": f"steps reported: {sorted(steps)}"}
    t = [steps[s]["t"] for s in range(total)]
    after = [b - a for a, b in zip(t[warmup - 1 :], t[warmup:], strict=False)]
    step_s = statistics.median(after)
    losses = [steps[s]["loss"] for s in range(total)]
    return {
        "step_s": step_s, "tokens_per_s": TOKENS_PER_STEP / step_s,
        "final_loss": losses[-1], "last5_loss": statistics.fmean(losses[-5:]),
        "curve": [[t[s] - t[0], losses[s]] for s in range(total)],
    }  # fmt: skip


def _stage_seconds(nodes, warmup: int) -> dict:
    """Per host, medians after the warm-up of what its steps spent computing (``busy_s``),
    waiting for frames (``wait_s``) and in all (``seconds``: the runner's step, from its start
    to the summary; the rest of the interval between steps is the trainer's), and the phases
    after the schedule (StepReport.phases): where a step's time goes, beside the estimate."""
    keys = ("busy_s", "wait_s", "seconds", "busy_cpu_s", "step_cpu_s", *PHASES)
    out: dict[str, dict[str, float]] = {key: {} for key in keys}
    for node in nodes:
        steps = [e for e in node.snapshot() if e["event"] == "step" and e["step"] >= warmup]
        for key in out:
            if steps and key in steps[0]:
                out[key][node.name] = statistics.median(e[key] for e in steps)
    return out


def _layout(event: dict) -> str:
    """Who holds which layers, from an epoch or train_plan event."""
    return json.dumps([event["stages"], event.get("ranges")])


def _plans(nodes, hosts: dict[str, str]) -> dict:
    """The plans trained (by steps run under each), the longest one's estimate, hosts and
    step time (``plan_step_s``: the estimate's measured counterpart; ``step_s`` mixes every
    plan the run trained, switches included).

    A plan here is a layout: who holds which layers. The swarm re-proposes the plan it
    trains under a new digest when only its figures move (the members published their
    measured stretch: control/stretch.py); ``plans_trained`` counts digests,
    ``layouts_trained`` layouts. ``estimate_s`` is the planner's latest estimate of the
    longest-trained layout, retimed on its view of the swarm then, in an epoch that began
    before the run's last step (one after it re-timed a plan nobody trained any more: C,
    session 17, 0.176 s where the last estimate the steps ran under was 0.215);
    ``adopted_estimate_s`` the one it was first proposed with."""
    merged = _merged_steps(nodes)
    last_t = max((s["t"] for s in merged.values()), default=float("inf"))
    latest, adopted, stages, first, proposed = {}, {}, {}, [], {}
    for node in nodes:
        for e in (e for e in node.snapshot() if e["event"] == "epoch"):
            first.append((e["epoch"], e["estimate"]))
            proposed[e["digest"]] = e["estimate"]
            layout, now = _layout(e), (e["epoch"], e.get("retimed") or e["estimate"])
            if e.get("t", 0.0) <= last_t:
                latest[layout] = max(latest.get(layout, now), now)
            adopted[layout] = min(adopted.get(layout, now), (e["epoch"], e["estimate"]))
            stages[layout] = [[hosts.get(p, p[:8]) for p in s] for s in e["stages"]]
    starts = sorted({(e["start_step"], e["digest"], _layout(e)) for n in nodes
                     for e in n.snapshot() if e["event"] == "train_plan"})  # fmt: skip
    segments = _segments(starts, len(merged))
    runs: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for start, end, _, layout in segments:
        runs[layout] = runs.get(layout, 0) + max(0, end - start)
        spans.setdefault(layout, []).append((start, end))
    longest = max(runs, key=runs.get, default=None)
    times = {step: s["t"] for step, s in merged.items()}
    # Every plan (digest) trained, in order, with the estimate it was proposed with and its
    # own step time: a run's first plan is estimated before any member measured its stretch
    # (the layout's figures below are its latest).
    each_plan = [{"start": start, "steps": max(0, end - start),
                  "estimate_s": proposed.get(digest),
                  "step_s": plan_step_s(times, [(start, end)])}
                 for start, end, digest, _ in segments]  # fmt: skip
    return {
        "plans_trained": len({digest for _, digest, _ in starts}),
        "layouts_trained": len(runs),
        "plan": stages.get(longest),
        "estimate_s": latest[longest][1] if longest in latest else None,
        "adopted_estimate_s": adopted[longest][1] if longest in adopted else None,
        "plan_steps": runs.get(longest, 0),
        "plan_step_s": plan_step_s(times, spans.get(longest, [])),
        "first_estimate_s": min(first)[1] if first else None,  # the first plan adopted
        "each_plan": each_plan,
    }


def _segments(starts: list[tuple[int, str, str]], steps: int) -> list[tuple[int, int, str, str]]:
    """(first step, end, digest, layout) of each plan trained, from its train_plan starts:
    a plan runs until the next one starts, the last until the run's last step."""
    ends = [nxt for nxt, _, _ in starts[1:]] + [None]
    return [(start, end if end is not None else max(start, steps), digest, layout)
            for (start, digest, layout), end in zip(starts, ends, strict=True)]  # fmt: skip


def plan_step_s(times: dict[int, float], spans: list[tuple[int, int]]) -> float | None:
    """The median interval between consecutive steps of one plan, ``times`` being when each
    step was reported and ``spans`` the plan's runs of steps [start, end). A span's first two
    intervals are left out: the switch (barrier, state moved) with the plan's first step,
    and its second step, still warming up. None with fewer than 3 intervals."""
    gaps = [times[s] - times[s - 1] for start, end in spans for s in range(start + 2, end)
            if s in times and s - 1 in times]  # fmt: skip
    return statistics.median(gaps) if len(gaps) >= 3 else None


def main_thread_cpu_s(pid: int) -> float | None:
    """CPU seconds of process ``pid``'s main thread so far, None if it is gone. A node's main
    thread runs its daemon's epoch loop: planning (py-spy on a B host, session 18)."""
    try:
        for thread in psutil.Process(pid).threads():
            if thread.id == pid:
                return thread.user_time + thread.system_time
    except psutil.Error:
        return None
    return None


def _host_cpu(
    cpu: dict, counters: dict, warmup: int, steps: int, main: dict | None = None
) -> dict[str, dict]:
    """Per host, between the warm-up's end and the last step: the cores its processes used
    (beside its share), their CPU seconds per step, the share of the quota's periods where
    it ran out (a host whose quota runs out every period is bound by its CPU), and its node's
    main thread's CPU seconds per step (``main``: per mark, per host). A host whose
    processes' CPU fell meanwhile (the killed run's victim: its node died unreaped) gets None
    for the CPU figures."""
    if warmup not in cpu or steps - 1 not in cpu:
        return {}
    n = counters[steps - 1]["step"] - counters[warmup]["step"]
    main = main or {}
    out = {}
    for host, b in cpu[steps - 1].items():
        a = cpu[warmup][host]
        used, periods = b.cpu_s - a.cpu_s, b.periods - a.periods
        known = used >= 0
        m0, m1 = main.get(warmup, {}).get(host), main.get(steps - 1, {}).get(host)
        main_s = m1 - m0 if m0 is not None and m1 is not None and m1 >= m0 else None
        out[host] = {
            "cores": used / max(b.at - a.at, 1e-9) if known else None,
            "cpu_per_step_s": used / n if n > 0 and known else None,
            "throttled": (b.throttled - a.throttled) / periods if periods > 0 else 0.0,
            "main_thread_per_step_s": main_s / n if n > 0 and main_s is not None else None,
        }
    return out


def _wire(counters: dict[int, dict], warmup: int, steps: int) -> dict[str, float]:
    """Bytes per step on every emulated link between the warm-up's end and the last step."""
    a, b = counters.get(warmup), counters.get(steps - 1)
    if a is None or b is None or b["step"] <= a["step"]:
        return {}
    span = b["step"] - a["step"]
    per_step = {}
    for name, fifo in b.items():
        if name.startswith("link:") and isinstance(fifo, dict):
            sent = fifo["bytes"] - a[name]["bytes"]
            if sent > 1024 * span:  # links that carried more than control chatter
                per_step[name[5:]] = sent / span
    return per_step


def run_topology(
    name: str, methods: list[str], steps: int, keep: Path | None = None, *,
    rehearse_s: float = REHEARSE_S,
) -> dict:  # fmt: skip
    topology = load_topology(name)
    devices = host_devices(topology)
    results = []
    with tempfile.TemporaryDirectory() as tmp, Testbed(topology) as bed:
        root = keep / topology.name if keep else Path(tmp)
        for method in methods:
            print(f"[{topology.name}] {method}: {steps} steps ...", file=sys.stderr, flush=True)
            try:
                results.append(run_method(bed, Path(root), method, steps, devices,
                                          rehearse_s=rehearse_s))  # fmt: skip
            except (TimeoutError, AssertionError) as exc:  # one failed run, not the others
                logs = "".join(p.read_text()[-1500:] for p in Path(root, method).glob("*.log"))
                results.append({"method": method, "steps": steps, "error": f"{exc}"[:3000],
                                "logs": logs})  # fmt: skip
                print(f"[{topology.name}] {method} failed: {str(exc)[:300]}", file=sys.stderr)
    return {"topology": topology.name, "devices": devices, "runs": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", action="append", help="A, B, C, mini or a file (B and C)")
    parser.add_argument("--method", action="append", choices=sorted([*METHODS, KILLED]),
                        help="(all four, then opfence-kill)")  # fmt: skip
    parser.add_argument("--steps", type=int, help="steps per run (80; --quick: 30)")
    parser.add_argument("--quick", action="store_true", help="mini, naive and opfence, 30 steps")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    parser.add_argument("--keep", type=Path, help="keep every node's log under this folder")
    parser.add_argument("--rehearse-s", type=float, default=REHEARSE_S,
                        help="each node's rehearsal, s (%(default)s; 0: none)")  # fmt: skip
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"testbed unavailable: {reason}", file=sys.stderr)
        return 1
    topologies = args.topology or (QUICK["topologies"] if args.quick else ["B", "C"])
    methods = args.method or (QUICK["methods"] if args.quick else [*METHODS, KILLED])
    steps = args.steps or (QUICK["steps"] if args.quick else 80)
    if steps < 10:
        parser.error("--steps must be at least 10 (a warm-up, then medians)")
    started = time.time()
    results = {"command": " ".join(sys.argv), "started": started, "topologies": []}
    for name in topologies:
        results["topologies"].append(run_topology(name, methods, steps, args.keep,
                                                  rehearse_s=args.rehearse_s))  # fmt: skip
        results["seconds"] = time.time() - started
        if args.json:  # after each topology: a later failure keeps what was measured
            args.json.write_text(json.dumps(results, indent=2))
    print_tables(results)
    if args.plots:
        write_plots(results, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
