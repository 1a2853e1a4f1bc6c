"""How a traced model is cut into a chain of pipeline stages, and what crosses each cut.

Link k joins stage k and stage k + 1. Its values are every value made before the cut (or a
model input) that a node after the cut needs; a value skipping several stages is relayed by
each stage in between, so a stage only ever talks to its neighbours. The values of one link
travel as one flat float32 tensor per micro-batch (the concatenation of their flattened
values, in ``LinkSpec.names`` order): one frame per link, direction and micro-batch, which is
also the unit AdaTopK compresses.
"""

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag import OpGraph
from fusionllm.dag.cuts import crossing_values, cut_problem

logger = get_logger(__name__)

WIRE_DTYPE = torch.float32


@dataclass(frozen=True)
class LinkSpec:
    """The values crossing one cut, for one micro-batch of the traced shape."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    def pack(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The link's values as one flat tensor, (numel,)."""
        parts = []
        for name, shape in zip(self.names, self.shapes, strict=True):
            value = values[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(value.shape)}")
            parts.append(value.detach().reshape(-1).to(WIRE_DTYPE))
        return torch.cat(parts)

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named values of a flat tensor made by ``pack`` (views into ``flat``)."""
        if tuple(flat.shape) != (self.numel,):
            raise ValueError(f"expected a flat tensor of {self.numel}, got {tuple(flat.shape)}")
        sizes = [math.prod(shape) for shape in self.shapes]
        return {
            name: part.view(shape)
            for name, shape, part in zip(
                self.names, self.shapes, torch.split(flat, sizes), strict=True
            )
        }


def balanced_cuts(graph: OpGraph, stages: int) -> tuple[int, ...]:
    """``stages - 1`` valid cuts splitting the forward FLOPs about evenly, on cheap links.

    Each cut is the valid position with the fewest crossing bytes among those whose FLOP
    prefix is within a quarter of a stage's share of its target (the nearest one if none is).
    A stand-in for the OP-Fence planner when a run just asks for S stages.
    """
    ids = graph.node_ids
    if not 1 <= stages <= len(ids):
        raise ConfigError(f"stages must be in [1, {len(ids)}], got {stages}")
    valid = [c for c in range(1, len(ids)) if cut_problem(graph, c) is None]
    if len(valid) < stages - 1:
        raise ConfigError(f"only {len(valid)} valid cuts for {stages} stages")
    flops = list(itertools.accumulate(graph.node(i).forward_flops for i in ids))
    total = flops[-1]
    share = total / stages

    def crossing_bytes(cut: int) -> int:
        return sum(graph.node(n).output_bytes for n in crossing_values(graph, cut))

    cuts: list[int] = []
    for k in range(1, stages):
        target = share * k
        lower = cuts[-1] if cuts else 0
        options = [c for c in valid if c > lower]
        # Leave enough valid cuts for the stages after this one.
        options = options[: len(options) - (stages - 1 - k)]
        near = [c for c in options if abs(flops[c - 1] - target) <= share / 4]
        if near:
            cuts.append(min(near, key=lambda c: (crossing_bytes(c), abs(flops[c - 1] - target))))
        else:
            cuts.append(min(options, key=lambda c: (abs(flops[c - 1] - target), c)))
    return tuple(cuts)


class PipelineLayout:
    """A chain of stages over an OpGraph: node ids per stage, links, tied parameters."""

    def __init__(self, graph: OpGraph, cuts: Sequence[int]) -> None:
        ids = graph.node_ids
        cuts = tuple(cuts)
        if list(cuts) != sorted(set(cuts)):
            raise ConfigError(f"cuts must be strictly increasing, got {list(cuts)}")
        for cut in cuts:
            if not 0 < cut < len(ids):
                raise ConfigError(f"cut {cut} is outside [1, {len(ids) - 1}]")
            problem = cut_problem(graph, cut)
            if problem is not None:
                raise ConfigError(f"cannot cut before node {cut} ({ids[cut]}): {problem}")
        self.graph = graph
        self.cuts = cuts
        bounds = [0, *cuts, len(ids)]
        self.stages: tuple[tuple[str, ...], ...] = tuple(
            ids[a:b] for a, b in itertools.pairwise(bounds)
        )
        links = []
        for cut in cuts:
            names = crossing_values(graph, cut)
            shapes = tuple(tuple(graph.value_meta(n).shape) for n in names)  # type: ignore[union-attr]
            links.append(LinkSpec(names, shapes))
        self.links: tuple[LinkSpec, ...] = tuple(links)
        self.tied = self._tied_parameters()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_module(self, stage: int) -> fx.GraphModule:
        """The stage's GraphModule (sharing the model's parameters: deep-copy it to own them)."""
        return self.graph.stage_module(self.stages[stage])

    def stage_parameter_names(self, stage: int) -> dict[str, str]:
        """Trained parameter name in the stage module -> canonical name. A frozen one (the
        base of a fine-tune) is not listed: it is never stepped, averaged, tied, checkpointed
        or moved, only read from the run's weights by every holder."""
        canonical = self.graph.canonical_parameter_names()
        module = self.stage_module(stage)
        return {name: canonical[name] for name, p in module.named_parameters() if p.requires_grad}

    def counted_elsewhere(self, stage: int) -> frozenset[str]:
        """Tied parameters this stage holds but whose gradient norm another stage counts.

        After the tied gradients are summed every holder has the same gradient; the global
        norm must count it once, so only its lowest-numbered holder does.
        """
        return frozenset(name for name, holders in self.tied.items() if stage in holders[1:])

    def _tied_parameters(self) -> dict[str, tuple[int, ...]]:
        holders: dict[str, list[int]] = {}
        for stage in range(self.num_stages):
            for canonical in set(self.stage_parameter_names(stage).values()):
                holders.setdefault(canonical, []).append(stage)
        return {name: tuple(s) for name, s in sorted(holders.items()) if len(s) > 1}

    def __repr__(self) -> str:
        sizes = [len(s) for s in self.stages]
        return f"PipelineLayout({self.num_stages} stages of {sizes} nodes, cuts {list(self.cuts)})"
