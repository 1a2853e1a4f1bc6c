"""Generation through a serving swarm on loopback beside generation in one process.

    python benchmarks/generate.py [--stages 1,2,4] [--prompt-len 32] [--new-tokens 32]
                                  [--rounds 5] [--quick] [--json PATH]

A GPT-2 small (random weights, seeded, written as a Hugging Face folder: nothing downloaded)
is served, for each stage count S, by S ``fusionllm node --task serve`` processes on 127.0.0.1
(``--min-stages/--max-stages S``, ``--threads 1``, one stage each), read by a client that is
not a member (``connect_swarm``) with fp16 activations off and on. ``local`` is the same folder
generating in this process (``LocalSource``, one torch thread), measured in the same rounds:
each round runs local, fp32 and fp16 once, in an order that rotates, so a load change on the
machine hits all three alike. Greedy decoding, the same prompt every time. Per configuration:

- ``first_token_s``: from asking to the first new token (prefill, sessions opened on every
  stage, one sample), median over rounds;
- ``token_ms``: the time between consecutive new tokens (one token through every stage and
  back), median and p90 over every step of every round;
- ``tokens_per_s``: new tokens / the request's whole time, median over rounds; ``x_local``:
  the median over rounds of this over local's in the same round;
- ``hop_ms``: (the swarm's median ``token_ms`` - local's) / stages: what one stage adds to a
  token beyond compute that local does too (a round trip from the client, framing, a node's
  event loop);
- ``match``: positions where the output equals local generation's (of ``--new-tokens``), and
  ``prefix``: how many first tokens equal it (after a first difference the two continue
  different texts). ``stable``: every round gave the same ids. At one stage no activation
  crosses a link (the client gets ids in and fp32 logits back), so fp16 against fp32 there
  is an A/A comparison: the run-to-run spread.

``--quick``: the tiny preset (2 blocks), 1 and 2 stages, a short prompt, 2 rounds, the
tests' fast control plane (a smoke test: seconds of compute once the nodes are up). Options
given beside it win.
"""

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from fusionllm.dag.models.gpt2 import GPT2, PRESETS
from fusionllm.dag.models.pretrained import save_pretrained
from fusionllm.node.local_swarm import CALM, LocalSwarm, wait_for
from fusionllm.node.serve.api import SamplingParams
from fusionllm.node.serve.client import connect_swarm
from fusionllm.node.serve.local import LocalSource

QUICK = {"preset": "tiny", "stages": "1,2", "prompt_len": 8, "new_tokens": 8, "rounds": 2,
         "control": "fast"}  # fmt: skip
# The nodes' control-plane timing: CALM's probes and epochs disturb the timing less (the
# figures), FAST's 2 s epochs find a plan sooner (the smoke test).
CONTROL = {"calm": CALM, "fast": {}}
CONFIGS = ("local", "fp32", "fp16")
_START_S = 300.0  # launch -> every node serving one plan (4 nodes load on 2 shared cores)


def write_folder(root: Path, preset: str, seed: int, layers: int | None = None) -> dict:
    """A seeded random GPT-2 of ``preset`` (``layers`` blocks if given) as a Hugging Face
    folder under ``root``: its path and sizes."""
    torch.manual_seed(seed)
    config = PRESETS[preset] if layers is None else replace(PRESETS[preset], n_layer=layers)
    model = GPT2(config)
    folder = save_pretrained(model, root / f"gpt2-{preset}")
    sizes = {"blocks": config.n_layer, "width": config.n_embd, "vocab": config.vocab_size}
    return {"folder": folder, "parameters": model.num_parameters(), **sizes}


def prompt_of(vocab: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


async def timed(source, prompt: list[int], params: SamplingParams) -> dict:
    """One request's ids and clock: when each new token arrived, from asking."""
    began = time.perf_counter()
    stamps, ids = [], []
    stream = source.stream(prompt, params)
    try:
        async for token in stream:
            stamps.append(time.perf_counter() - began)
            ids.append(token)
    finally:
        await stream.aclose()
    return {
        "ids": ids,
        "first_token_s": stamps[0],
        "gaps_s": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens_per_s": len(ids) / stamps[-1],
    }


def start_swarm(root: Path, folder: Path, stages: int, control: str) -> tuple[LocalSwarm, float]:
    """``stages`` serving nodes, one per stage; seconds from launch to one serving plan."""
    root.mkdir(parents=True)
    extra = {"task": "serve", "model-dir": str(folder), "min-stages": stages,
             "max-stages": stages, "threads": 1, "seq-len": 16, "micro-batches": 2,
             "session-idle": 120, **CONTROL[control]}  # fmt: skip
    swarm = LocalSwarm(root, extra=extra)
    launched = time.monotonic()
    try:
        first = swarm.start("n0")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        for i in range(1, stages):
            swarm.start(f"n{i}", bootstrap=first.dht_addr)
        wait_for(lambda: serving_plan(swarm.nodes, stages), _START_S, f"{stages} stages serving")
    except BaseException:
        print(swarm.logs(), file=sys.stderr)
        swarm.close()
        raise
    return swarm, time.monotonic() - launched


def serving_plan(nodes, stages: int) -> bool:
    """Every node follows the same plan, of ``stages`` stages, one node on each."""
    plans = [n.last("serve_plan") for n in nodes]
    if any(p is None or p["stage"] is None or p["stages"] != stages for p in plans):
        return False
    return len({p["digest"] for p in plans}) == 1 and {p["stage"] for p in plans} == set(
        range(stages)
    )


async def measure(sources: dict, prompt: list[int], params: SamplingParams, rounds: int) -> dict:
    """Every configuration once untimed (caches, connections, first-call costs), then
    ``rounds`` rounds of all of them in a rotating order; each configuration's runs."""
    for source in sources.values():
        await timed(source, prompt, params)
    runs: dict[str, list[dict]] = {name: [] for name in sources}
    names = list(sources)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(await timed(sources[name], prompt, params))
    return runs


def summarise(runs: list[dict], baseline: list[dict], reference: list[int]) -> dict:
    """One configuration's figures from its runs and local's runs of the same rounds."""
    gaps = sorted(g for run in runs for g in run["gaps_s"])
    ids = runs[0]["ids"]
    same = [a == b for a, b in zip(ids, reference, strict=True)]
    prefix = same.index(False) if False in same else len(same)
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline, strict=True)]
    return {
        "first_token_s": round(statistics.median(r["first_token_s"] for r in runs), 4),
        "token_ms_median": round(1e3 * statistics.median(gaps), 2),
        "token_ms_p90": round(1e3 * gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))], 2),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
        "x_local": round(statistics.median(ratios), 3),
        "match": sum(same),
        "prefix": prefix,
        "stable": all(r["ids"] == ids for r in runs),
        "ids": ids,
    }


async def bench_stages(args, local: LocalSource, swarm: LocalSwarm, stages: int, prompt) -> dict:
    """local, fp32 and fp16 through this swarm, in alternating rounds."""
    bootstrap = [swarm.nodes[0].dht_addr]
    sources = {"local": local}
    try:
        for config, fp16 in (("fp32", False), ("fp16", True)):
            sources[config] = await connect_swarm(
                bootstrap, model=args.model, timeout=120, fp16=fp16
            )
        params = SamplingParams(max_new_tokens=args.new_tokens)
        runs = await measure(sources, prompt, params, args.rounds)
        hops = {c: len(sources[c].peers_in_use) for c in ("fp32", "fp16")}
    finally:
        for config, source in sources.items():
            if config != "local":
                await source.aclose()
    reference = runs["local"][0]["ids"]
    rows = {c: summarise(runs[c], runs["local"], reference) for c in CONFIGS}
    # What a stage adds to a token beyond its compute (which local also does): a round trip
    # from the client, framing, the node's event loop.
    local_ms = rows["local"]["token_ms_median"]
    hop_ms = {c: round((rows[c]["token_ms_median"] - local_ms) / stages, 2) for c in hops}
    return {"stages": stages, "hops": hops, "hop_ms": hop_ms, "rows": rows}


def run(args: argparse.Namespace, root: Path) -> list[dict]:
    torch.set_num_threads(1)  # as each node computes (--threads 1)
    model = write_folder(root, args.preset, args.seed, args.layers)
    folder = model.pop("folder")
    args.model = folder.name  # the name the swarm must serve
    local = LocalSource.from_folder(folder)
    prompt = prompt_of(local.vocab_size, args.prompt_len, args.seed + 1)
    print(f"GPT-2 {args.preset}: {model['parameters']:,} parameters, {model['blocks']} blocks; "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.rounds} rounds, one "
          f"torch thread per process", flush=True)  # fmt: skip
    results = []
    for stages in args.stage_counts:
        print(f"starting {stages} serving node(s)...", flush=True)
        swarm, start_s = start_swarm(root / f"swarm{stages}", folder, stages, args.control)
        try:
            result = asyncio.run(bench_stages(args, local, swarm, stages, prompt))
        finally:
            swarm.close()
        result["start_s"] = round(start_s, 1)
        print_result(result, args.new_tokens)
        results.append(result)
        if args.json:  # after each stage count: a run cut short keeps what it measured
            report = {"args": vars(args), "model": model, "results": results}
            Path(args.json).write_text(json.dumps(report, indent=1))
    return results


def print_result(result: dict, new_tokens: int) -> None:
    print(f"{result['stages']} stage(s): nodes serving {result['start_s']:.0f} s after launch, "
          f"hops per request {result['hops']}, each adding {result['hop_ms']} ms a token "
          f"beyond local's")  # fmt: skip
    print(f"  {'run':<6} {'first s':>8} {'token ms':>9} {'p90 ms':>8} {'tokens/s':>9} "
          f"{'x local':>8} {'match':>7} {'prefix':>7} {'stable':>7}")  # fmt: skip
    for config, row in result["rows"].items():
        print(
            f"  {config:<6} {row['first_token_s']:>8.3f} {row['token_ms_median']:>9.1f} "
            f"{row['token_ms_p90']:>8.1f} {row['tokens_per_s']:>9.1f} {row['x_local']:>8.2f} "
            f"{row['match']:>3}/{new_tokens:<3} {row['prefix']:>7} {row['stable']!s:>7}",
            flush=True,
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="small", help="GPT-2 size (%(default)s)"
    )
    parser.add_argument("--layers", type=int, help="blocks instead of the preset's")
    parser.add_argument("--stages", default="1,2,4", help="stage counts (%(default)s)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt ids (%(default)s)")
    parser.add_argument("--new-tokens", type=int, default=32, help="per request (%(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (%(default)s)")
    parser.add_argument(
        "--control", choices=sorted(CONTROL), default="calm", help="nodes' timing (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt (%(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    if parser.parse_known_args(argv)[0].quick:  # its values as defaults: given options win
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    args.stage_counts = [int(s) for s in str(args.stages).split(",")]
    if min(args.stage_counts) < 1 or args.rounds < 1 or args.new_tokens < 2:
        parser.error("need stages >= 1, rounds >= 1 and new-tokens >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fusionllm-generate-") as tmp:
        run(args, Path(tmp))
    print(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
