"""Where a traced model can be cut into pipeline stages, and what crosses each cut.

A cut before position ``c`` sends every value made before it (or a model input) that a node
from ``c`` on needs. The runtime ships those as one flat float tensor per micro-batch, so a
cut is usable only if every crossing value is a single floating-point tensor and no model
output is made before it. The planner never proposes the other cuts (``GraphCosts.uncuttable``).
"""

from collections.abc import Sequence
from typing import Protocol

from fusionllm.dag.flops import TensorMeta


class CutView(Protocol):
    """What cutting needs of a traced graph (``OpGraph`` has it); a protocol, so that
    ``opgraph`` can ask this module for its uncuttable positions without a circle."""

    @property
    def node_ids(self) -> Sequence[str]: ...

    @property
    def input_names(self) -> Sequence[str]: ...

    @property
    def output_names(self) -> Sequence[str]: ...

    def node(self, node_id: str): ...

    def value_meta(self, name: str): ...


def crossing_values(graph: CutView, cut: int) -> tuple[str, ...]:
    """Values made before position ``cut`` (or model inputs) that nodes from ``cut`` on need."""
    ids = graph.node_ids
    if not 0 < cut < len(ids):
        raise ValueError(f"a cut must be in [1, {len(ids) - 1}], got {cut}")
    before = set(ids[:cut]) | set(graph.input_names)
    needed: dict[str, None] = {}
    for node_id in ids[cut:]:
        for name in graph.node(node_id).inputs:
            if name in before:
                needed[name] = None
    for name in graph.output_names:
        if name in before:
            needed[name] = None
    return tuple(needed)


def cut_problem(graph: CutView, cut: int) -> str | None:
    """Why a cut cannot be a pipeline link (a value is not a float tensor), or None."""
    for name in crossing_values(graph, cut):
        meta = graph.value_meta(name)
        if not isinstance(meta, TensorMeta):
            return f"value {name!r} crossing the cut is not a single tensor"
        if not meta.dtype.is_floating_point:
            return f"value {name!r} crossing the cut is {meta.dtype}, not a float"
        if name in graph.output_names:
            return f"model output {name!r} would be made before the last stage"
    return None


def uncuttable(graph: CutView) -> frozenset[int]:
    """Positions in [1, len(nodes)) where ``cut_problem`` finds a reason not to cut."""
    return frozenset(c for c in range(1, len(graph.node_ids)) if cut_problem(graph, c) is not None)
