"""Where the planner's estimate and a testbed run's measured step part: per run, from the JSON.

Reads results JSONs of ``benchmarks/testbed.py`` and prints, per run, the estimate beside the
measured step (median after the warm-up) and what the hosts' own step reports say of it, per
host medians (benchmarks/testbed.py ``_stage_seconds``):

- ``busy``: the busiest seated host's compute (forwards and backwards) per step;
- ``cpu``: the largest ``seconds - wait`` of a seated host: its step less its waits for
  frames, so compute plus the work around it (packing, sending, summaries, the optimizer);
- ``gap``: the measured step less the longest runner step: what happens between steps
  (the trainer's events, pace checks, checkpoints, votes);
- ``err``: measured less estimated, in seconds and as ``est/meas``;
- ``plan s``: the median step of the estimated plan's own steps (``plan_step_s``, recorded
  since session 8; ``step_s`` mixes every plan a run trained), ``-`` where not recorded.

A miss by a fixed per-step amount shows as ``err`` alike across runs; one by latency as ``err``
growing with the stages and the round trips; one by compute as ``cpu`` moving with ``err``.

    python -m benchmarks.testbed_errors docs/results/s7/*.json docs/results/s8/*.json
"""

import argparse
import json
import statistics
from pathlib import Path


def run_rows(path: Path) -> list[dict]:
    rows = []
    for top in json.loads(path.read_text())["topologies"]:
        for run in top["runs"]:
            if "step_s" not in run or not run.get("plan") or run.get("estimate_s") is None:
                continue
            seated = [h for stage in run["plan"] for h in stage]
            known = [h for h in seated if h in run["seconds"]]
            if not known:
                continue
            runner = max(run["seconds"][h] for h in known)
            rows.append({
                "file": path.name, "topology": top["topology"], "method": run["method"],
                "stages": len(run["plan"]), "estimate": run["estimate_s"],
                "measured": run["step_s"], "plan_s": run.get("plan_step_s"),
                "busy": max(run["busy_s"][h] for h in known),
                "cpu": max(run["seconds"][h] - run["wait_s"][h] for h in known),
                "gap": run["step_s"] - runner,
            })  # fmt: skip
    return rows


def _plan(row: dict) -> str:
    own = row["plan_s"]
    return f"{own:6.3f} {row['estimate'] / own:8.2f}" if own else f"{'-':>6} {'-':>8}"


def summary(rows: list[dict]) -> list[str]:
    errs = [r["measured"] - r["estimate"] for r in rows]
    ratios = [r["estimate"] / r["measured"] for r in rows]
    within = sum(0.75 <= x <= 1.25 for x in ratios)
    return [
        f"{len(rows)} runs: est/meas median {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}), within 25% {within}/{len(rows)}",
        f"under-estimates {sum(e > 0 for e in errs)}, over-estimates {sum(e < 0 for e in errs)};"
        f" err median {statistics.median(errs) * 1e3:+.0f} ms, "
        f"gap median {statistics.median(r['gap'] for r in rows) * 1e3:+.0f} ms",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="benchmarks/testbed.py JSONs")
    args = parser.parse_args()
    rows = [r for path in args.results for r in run_rows(path)]
    print(f"{'file':<16} {'method':<14} S  {'est s':>6} {'meas s':>7} {'est/meas':>8} "
          f"{'err ms':>7} {'busy s':>7} {'cpu s':>6} {'gap ms':>7} "
          f"{'plan s':>6} est/plan")  # fmt: skip
    for r in rows:
        print(f"{r['file']:<16} {r['method']:<14} {r['stages']}  {r['estimate']:6.3f} "
              f"{r['measured']:7.3f} {r['estimate'] / r['measured']:8.2f} "
              f"{(r['measured'] - r['estimate']) * 1e3:+7.0f} {r['busy']:7.3f} {r['cpu']:6.3f} "
              f"{r['gap'] * 1e3:+7.0f} {_plan(r)}")  # fmt: skip
    if rows:
        print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
