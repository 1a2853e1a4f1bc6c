"""Tables and PNG plots of benchmarks/testbed.py's results (one dict, as its --json writes).

    python -m benchmarks.testbed_report RESULTS.json [--plots DIR]

Speed-ups are against the better of naive and balanced measured on the same topology in the
same invocation; the time to a target loss uses the highest last-5-step mean loss of the
topology's runs as the target, so every method reaches it.
"""

import argparse
import json
import sys
from pathlib import Path

BASELINES = ("naive", "balanced")
KILLED = "opfence-kill"


def _baseline_rate(runs: list[dict]) -> float | None:
    rates = [r["tokens_per_s"] for r in runs if r["method"] in BASELINES and "tokens_per_s" in r]
    return max(rates) if rates else None


def _time_to(run: dict, target: float) -> float | None:
    """Seconds from the first step to the first 5-step mean loss at or below ``target``."""
    curve = run.get("curve", [])
    for i in range(4, len(curve)):
        if sum(loss for _, loss in curve[i - 4 : i + 1]) / 5 <= target:
            return curve[i][0]
    return None


def _method_rows(topology: dict) -> list[str]:
    runs = topology["runs"]
    base = _baseline_rate(runs)
    target = max((r["last5_loss"] for r in runs if "last5_loss" in r and r["method"] != KILLED),
                 default=None)  # fmt: skip
    head = (f"{'method':14} {'step s':>7} {'tok/s':>7} {'x best':>7} {'est s':>7} "
            f"{'est/meas':>8} {'plan s':>7} {'est/plan':>8} {'adopt s':>7} {'loss@N':>7} "
            f"{'last5':>7} {'t→target':>8} {'plans':>5}  plan (hosts per stage)")  # fmt: skip
    rows = [f"topology {topology['topology']} (target loss {target})", head]
    for r in runs:
        if "error" in r:
            rows.append(f"{r['method']:14} error: {r['error'][:80]}")
            continue
        speedup = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        est = r.get("estimate_s")
        ratio = f"{est / r['step_s']:.2f}" if est else "-"
        # the longest plan's own steps (runs before session 8 did not record them)
        own = r.get("plan_step_s")
        own_ratio = f"{est / own:.2f}" if est and own else "-"
        reach = _time_to(r, target) if target is not None else None
        rows.append(
            f"{r['method']:14} {r['step_s']:7.3f} {r['tokens_per_s']:7.0f} {speedup:>7} "
            f"{est or 0:7.3f} {ratio:>8} {own or 0:7.3f} {own_ratio:>8} "
            f"{r.get('adopted_estimate_s') or 0:7.3f} "
            f"{r['final_loss']:7.3f} {r['last5_loss']:7.3f} "
            f"{reach if reach is None else round(reach, 1)!s:>8} {r['plans_trained']:5d}  "
            f"{r['plan']}"
        )
    return rows


def _per_run(topology: dict, title: str, field: str, show=str) -> list[str]:
    """A titled row per run: the run's ``field`` (a dict) as "key value" pairs, sorted."""
    rows = [f"{title}:"]
    for r in topology["runs"]:
        items = ", ".join(f"{k} {show(v)}" for k, v in sorted(r.get(field, {}).items()))
        rows.append(f"  {r['method']:14} {items or '-'}")
    return rows


def _wire_rows(topology: dict) -> list[str]:
    title = f"bytes per step on the emulated links ({topology['topology']}, KiB)"
    return _per_run(topology, title, "wire", lambda nbytes: f"{nbytes / 1024:.0f}")


def _each_plan_rows(topology: dict) -> list[str]:
    """Per run, every plan it trained: first step +steps, estimate / own step time."""
    rows = [f"each plan trained ({topology['topology']}; from step +steps: est s / step s):"]
    for r in topology["runs"]:
        plans = [f"{p['start']}+{p['steps']}: {p['estimate_s'] or 0:.3f} / {p['step_s'] or 0:.3f}"
                 for p in r.get("each_plan", [])]  # fmt: skip
        rows.append(f"  {r['method']:14} {'; '.join(plans) or '-'}")
        rehearsed = r.get("rehearsed") or {}
        if any(v is not None for v in rehearsed.values()):
            figures = ", ".join(f"{h} {v or 0:.3g}" for h, v in sorted(rehearsed.items()))
            rows.append(f"  {'':14} rehearsed stretch: {figures}")
    return rows


def _cpu_rows(topology: dict) -> list[str]:
    """Per run and host: the cores its processes used (of its share), their CPU per step, the
    training thread's (``step_cpu_s``, of it ``busy_cpu_s`` computing) and the node's main
    thread's, and the share of quota periods that ran out."""
    rows = [
        f"host CPU after the warm-up ({topology['topology']}; cores used of the share, CPU "
        "ms per step: all processes / the training thread / its compute / the node's main "
        "thread (its epoch loop: planning), quota ran out in):"
    ]
    shares = {h: d["name"].removeprefix("cpu-x") for h, d in topology.get("devices", {}).items()}
    for r in topology["runs"]:
        for host, c in sorted(r.get("host_cpu", {}).items()):
            per = c["cpu_per_step_s"]
            step_cpu = r.get("step_cpu_s", {}).get(host)
            busy_cpu = r.get("busy_cpu_s", {}).get(host)
            main = c.get("main_thread_per_step_s")
            ms = [f"{1e3 * v:.0f}" if v is not None else "-"
                  for v in (per, step_cpu, busy_cpu, main)]  # fmt: skip
            cores = "-" if c["cores"] is None else f"{c['cores']:.2f}"
            rows.append(f"  {r['method']:14} {host:4} {cores:>4} of {shares.get(host, '?')}"
                        f"  {' / '.join(ms)}  {100 * c['throttled']:.0f}% of periods")  # fmt: skip
    return rows


def _link_rows(topology: dict) -> list[str]:
    rows = [f"links measured by the nodes ({topology['topology']}, mid-run, under training load; "
            "'start': as training began):",
            f"  {'method':14} {'link':10} {'cap MB/s':>8} {'measured':>8} {'start':>6} "
            f"{'rtt ms':>7} {'measured':>8}"]  # fmt: skip
    for r in topology["runs"]:
        start = {(x["src"], x["dst"]): x["measured_mb_s"] for x in r.get("links_start", [])}
        for link in r.get("links", []):
            cap = f"{link['cap_mb_s']:.2f}" if link["cap_mb_s"] else "-"
            first = start.get((link["src"], link["dst"]))
            rows.append(
                f"  {r['method']:14} {link['src'] + '>' + link['dst']:10} {cap:>8} "
                f"{link['measured_mb_s']:8.2f} {'-' if first is None else f'{first:.2f}':>6} "
                f"{link['rtt_ms']:7.1f} {link['measured_rtt_ms']:8.1f}"
            )
    rows.append("  within 20% of the cap (misses whose sender trained):")
    for r in topology["runs"]:
        trained = {h for h, n in r.get("node_steps", {}).items() if n > 0}
        parts = [f"{when} {_within(r.get(key, []), trained)}"
                 for when, key in (("start", "links_start"), ("mid-run", "links"))]  # fmt: skip
        rows.append(f"  {r['method']:14} {', '.join(parts)}")
    return rows


def _within(links: list[dict], trained: set[str]) -> str:
    capped = [x for x in links if x.get("cap_mb_s")]
    misses = [x for x in capped if abs(x["measured_mb_s"] / x["cap_mb_s"] - 1) > 0.2]
    by_trainers = sum(x["src"] in trained for x in misses)
    return f"{len(capped) - len(misses)}/{len(capped)} ({by_trainers} of {len(misses)})"


def _node_rows(topology: dict) -> list[str]:
    """Steps each host trained, per run (0: it never trained), and the killed run's recovery."""
    rows = _per_run(topology, f"steps trained per host ({topology['topology']})", "node_steps")
    for r in topology["runs"]:
        if r.get("killed"):
            recovery = r.get("recovery_s")
            rows.append(
                f"  {r['method']}: {r['killed']} SIGKILLed after step {r['killed_after_step']}; "
                f"recovered in {'-' if recovery is None else f'{recovery:.1f}'} s, "
                f"{r.get('steps_lost')} steps lost"
            )
    return rows


def tables(results: dict) -> str:
    lines: list[str] = []
    for topology in results["topologies"]:
        lines += [*_method_rows(topology), *_each_plan_rows(topology), *_node_rows(topology)]
        lines += [*_wire_rows(topology), *_cpu_rows(topology), *_link_rows(topology), ""]
    return "\n".join(lines)


def print_tables(results: dict) -> None:
    print(tables(results))


def write_plots(results: dict, folder: Path) -> list[Path]:
    """loss against wall time per topology, tokens/s per topology and method, and the
    planner's estimate against the measured step time; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    topologies = results["topologies"]
    written = []
    fig, axes = plt.subplots(1, len(topologies), figsize=(5 * len(topologies), 3.6), squeeze=False)
    for ax, topology in zip(axes[0], topologies, strict=True):
        for r in topology["runs"]:
            if r.get("curve"):
                ax.plot(*zip(*r["curve"], strict=True), label=r["method"])
        ax.set(title=f"topology {topology['topology']}", xlabel="wall time, s", ylabel="loss")
        ax.legend()
    written.append(_save(fig, folder / "loss_vs_time.png"))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    methods = sorted({r["method"] for t in topologies for r in t["runs"]})
    width = 0.8 / max(1, len(methods))
    for k, method in enumerate(methods):
        xs, ys = [], []
        for i, topology in enumerate(topologies):
            for r in topology["runs"]:
                if r["method"] == method and "tokens_per_s" in r:
                    xs.append(i + k * width)
                    ys.append(r["tokens_per_s"])
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(topologies))])
    ax.set_xticklabels([t["topology"] for t in topologies])
    ax.set(ylabel="tokens/s (median step)")
    ax.legend()
    written.append(_save(fig, folder / "tokens_per_s.png"))
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for topology in topologies:
        for r in topology["runs"]:
            if r.get("estimate_s") and r.get("step_s"):
                ax.scatter(r["estimate_s"], r["step_s"])
                ax.annotate(f"{topology['topology']} {r['method']}",
                            (r["estimate_s"], r["step_s"]), fontsize=7)  # fmt: skip
    top = max([*ax.get_xlim(), *ax.get_ylim()])
    ax.plot([0, top], [0, top], "k:", linewidth=0.8)
    ax.set(xlabel="planner's estimated step, s", ylabel="measured step, s")
    written.append(_save(fig, folder / "estimate_vs_measured.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a JSON file benchmarks/testbed.py wrote")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    print_tables(results)
    if args.plots:
        for path in write_plots(results, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
