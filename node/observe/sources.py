"""``Sources`` of a running node: its daemon, and its transport and trainer where it trains."""

from fusionllm.node.observe.pulled import Sources


def node_sources(daemon, transport=None, trainer=None) -> Sources:
    """What the metrics read at scrape time from these parts (None: a node that trains
    nothing has no transport or trainer of its own)."""
    return Sources(
        health=daemon.health,
        timings=daemon.timings.snapshot,
        members=lambda: len(daemon.members),
        transport_refusals=transport.refusals if transport is not None else None,
        connected=(lambda: len(transport.stats())) if transport is not None else None,
        frames_refused=(lambda: trainer.board.refused) if trainer is not None else None,
    )
