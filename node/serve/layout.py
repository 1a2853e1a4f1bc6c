"""Which decoder blocks each stage of an adopted plan serves: pure and deterministic.

Nodes agree on a plan with the training machinery (members, stages, replicas per stage);
serving keeps its chain of stages and replicas but cuts the model into contiguous spans of
whole blocks (``dag/models/decoding.py``), so every node and every client computes the same
spans from the same plan, with no extra record on the DHT.
"""

from dataclasses import dataclass

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RouteStage:
    """One hop of a route: blocks [start, stop) and the peers holding them (replicas)."""

    index: int
    start: int
    stop: int
    peers: tuple[str, ...]


def serving_spans(layers: int, stages: int) -> list[tuple[int, int]]:
    """Blocks [start, stop) per stage: as even as whole blocks allow, the earlier stages one
    block longer when they do not divide (the last stage also runs the head). One token's
    latency is the sum over stages, so evenness matters only for concurrent sessions; the
    count of stages is the plan's (never more than the blocks)."""
    if layers < 1 or stages < 1:
        raise ConfigError(f"need layers >= 1 and stages >= 1, got {layers} and {stages}")
    stages = min(stages, layers)
    base, extra = divmod(layers, stages)
    spans, start = [], 0
    for i in range(stages):
        stop = start + base + (1 if i < extra else 0)
        spans.append((start, stop))
        start = stop
    return spans


def serving_route(
    stage_peers: list[tuple[str, ...]], layers: int, backup: tuple[str, ...] = ()
) -> list[RouteStage]:
    """The route of a plan whose stages have these peers. The training plan's backup pool
    serves too: each backup peer (sorted) joins the stage with the fewest replicas (the first
    such), as serving gains capacity and survives a loss from every extra replica. A plan
    with more stages than blocks merges the surplus stages' peers into the last span."""
    spans = serving_spans(layers, len(stage_peers))
    peers = [list(p) for p in stage_peers[: len(spans)]]
    for surplus in stage_peers[len(spans) :]:
        peers[-1].extend(surplus)
    seated = {p for group in peers for p in group}
    for spare in sorted(set(backup) - seated):
        min(peers, key=len).append(spare)
    return [
        RouteStage(index=i, start=a, stop=b, peers=tuple(p))
        for i, ((a, b), p) in enumerate(zip(spans, peers, strict=True))
    ]


def span_of(route: list[RouteStage], peer: str) -> RouteStage | None:
    """The stage ``peer`` serves in ``route``, or None (a backup, or not in the plan)."""
    return next((s for s in route if peer in s.peers), None)
