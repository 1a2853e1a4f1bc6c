"""Every bulk probe a kept testbed run's nodes logged, against its link's configured cap.

    python -m benchmarks.testbed_probe_log RESULTS.json LOGS     # LOGS: testbed.py --keep's folder

Each node logs a bulk probe's figure and its counted samples (``node/p2p/lane/senders.py``);
this reads them back per run and prints how many probes each run took, the ones whose figure
or a sample reads over the cap (with the samples: what made it, docs/testbed.md session 20),
and the ones whose figure the queue-climb rule (``bulk_figure.without_queue_climbs``) moved
from the best but one of all samples. A figure in the book is the best of its recent probes,
so one over-read probe is a link over its cap mid-run.
"""

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(
    r"bulk probe to (?P<peer>\S+): (?P<figure>[\d.e+-]+) MB/s, rtt (?P<rtt>[\d.]+) ms, "
    r"from \d+ bytes; samples \(MB/s, \* in slow start\) (?P<samples>.*)$"
)
OVER = 1.05  # a figure this far over its cap is reported (the issue allows 20%)


@dataclass(frozen=True)
class ProbeLine:
    peer: str
    figure: float  # MB/s
    samples: tuple[float, ...]  # MB/s, in order
    slow_start: tuple[bool, ...]

    @property
    def every_sample_figure(self) -> float:
        """What the best but one of every counted sample reads (the figure before session 20)."""
        rates = sorted(self.samples)
        return rates[-2] if len(rates) > 1 else rates[0]


def parse_probe_line(line: str) -> ProbeLine | None:
    """A node log's bulk-probe line, or None for any other line (or one cut short)."""
    match = _LINE.search(line)
    if match is None:
        return None
    words = match["samples"].split()
    try:
        samples = tuple(float(w.rstrip("*")) for w in words)
    except ValueError:
        return None
    if not samples:
        return None
    return ProbeLine(match["peer"], float(match["figure"]), samples,
                     tuple(w.endswith("*") for w in words))  # fmt: skip


def _peer_names(folder: Path) -> dict[str, str]:
    names = {}
    for events in folder.glob("*.events.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "ready":
                names[event["peer_id"]] = events.name.split(".")[0]
                break
    return names


def run_report(folder: Path, caps: dict[tuple[str, str], float]) -> list[str]:
    """Lines for one run's folder: its probe count, then every probe worth a look."""
    names, lines, count = _peer_names(folder), [], 0
    for log in sorted(folder.glob("*.log")):
        src = log.stem
        for text in log.read_text(errors="replace").splitlines():
            probe = parse_probe_line(text)
            cap = caps.get((src, names.get(probe.peer, ""))) if probe else None
            if probe is None or cap is None:
                continue
            count += 1
            old, shown = probe.every_sample_figure, " ".join(text.split()[-len(probe.samples) :])
            link = f"{src}>{names[probe.peer]}"
            if probe.figure > OVER * cap or max(probe.samples) > OVER * cap:
                lines.append(f"  over: {link} cap {cap:g} figure {probe.figure:g} "
                             f"({probe.figure / cap:.2f}); samples {shown}")  # fmt: skip
            if abs(old - probe.figure) > 0.01 * probe.figure:
                lines.append(f"  moved by the queue-climb rule: {link} "
                             f"{old:g} ({old / cap:.2f}) -> {probe.figure:g} "
                             f"({probe.figure / cap:.2f})")  # fmt: skip
    return [f"{count} probes", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a benchmarks/testbed.py results JSON")
    parser.add_argument("logs", type=Path, help="the folder its --keep wrote")
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    for top in data["topologies"]:
        for run in top["runs"]:
            caps = {(k["src"], k["dst"]): k["cap_mb_s"] for k in run.get("links", [])}
            folder = args.logs / top["topology"] / run["method"]
            if not folder.is_dir():
                print(f"{top['topology']} {run['method']}: no logs in {folder}")
                continue
            report = run_report(folder, caps)
            print(f"{top['topology']} {run['method']}: " + "\n".join(report))


if __name__ == "__main__":
    main()
