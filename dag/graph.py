"""The OP-DAG: one node per operator with its costs; what the planner and the runtime share.

This file holds the data only (no tracing): tracing.py builds it, planning code reads it.
"""

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, kw_only=True)
class OpNode:
    """One operator (an fx node: a leaf module call, a function or a method call).

    node_id: stable across runs and processes (the fx node name of a deterministic trace).
    inputs: ids of the nodes, or names of graph inputs, whose values this node consumes.
    Costs are for the sample batch the graph was traced with; bytes are exact, FLOPs counted.
    peak_activation_bytes: what autograd keeps from this op until its backward. Summed over a
    stage it is the activation memory one in-flight micro-batch holds (the training peak is
    at the end of a stage's forward); the largest single ``output_bytes`` adds a transient.
    """

    node_id: str
    op: str
    inputs: tuple[str, ...]
    forward_flops: int
    backward_flops: int
    param_bytes: int
    output_bytes: int
    peak_activation_bytes: int

    def __post_init__(self) -> None:
        for name in (
            "forward_flops",
            "backward_flops",
            "param_bytes",
            "output_bytes",
            "peak_activation_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{self.node_id}: {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class GraphCosts:
    """The numeric view of an OpGraph that planning needs; cheap to build by hand in tests.

    nodes are in topological order; input_bytes gives the size of each graph input.
    """

    nodes: tuple[OpNode, ...]
    input_bytes: dict[str, int] = field(default_factory=dict)
    output_names: tuple[str, ...] = ()
    # Cut positions the runtime cannot ship (a non-float value crosses): never planned.
    uncuttable: frozenset[int] = frozenset()
    # Parameters several nodes use (GPT-2's wte and lm_head): (the users' positions, the
    # parameter's bytes). Stages that split them sum their gradients every step.
    shared_params: tuple[tuple[tuple[int, ...], int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "uncuttable", frozenset(self.uncuttable))
        bad = [c for c in self.uncuttable if not 0 < c < len(self.nodes)]
        if bad:
            raise ValueError(f"uncuttable positions {sorted(bad)} are not inside the graph")
        for users, nbytes in self.shared_params:
            if len(users) < 2 or list(users) != sorted(set(users)) or nbytes < 0:
                raise ValueError(f"shared parameter ({users}, {nbytes}): bad users or bytes")
            if not 0 <= users[0] <= users[-1] < len(self.nodes):
                raise ValueError(f"shared parameter users {users} are not inside the graph")
        seen: set[str] = set(self.input_bytes)
        for node in self.nodes:
            if node.node_id in seen:
                raise ValueError(f"duplicate node id {node.node_id!r}")
            missing = [name for name in node.inputs if name not in seen]
            if missing:
                raise ValueError(f"{node.node_id} consumes {missing} before they are made")
            seen.add(node.node_id)
        unknown = [name for name in self.output_names if name not in seen]
        if unknown:
            raise ValueError(f"outputs {unknown} are not nodes or inputs")

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(node.node_id for node in self.nodes)

    def cut_bytes(self) -> list[int]:
        """cut_bytes()[b]: activation bytes crossing a cut between nodes[:b] and nodes[b:].

        A value made before the cut and used after it (by any later node, or as a graph output)
        crosses once, however many stages later it is used. Index 0 and len(nodes) are 0 by
        definition: graph inputs are read by the stage that needs them, outputs stay put.
        """
        size = dict(self.input_bytes)
        size.update({node.node_id: node.output_bytes for node in self.nodes})
        position = {name: -1 for name in self.input_bytes}
        position.update({node.node_id: i for i, node in enumerate(self.nodes)})
        last_use = dict(position)
        for i, node in enumerate(self.nodes):
            for name in node.inputs:
                last_use[name] = max(last_use[name], i)
        for name in self.output_names:
            last_use[name] = len(self.nodes)
        # A value made at position p and last used at u crosses every cut b with p < b <= u.
        delta = [0] * (len(self.nodes) + 2)
        for name, made in position.items():
            if made < 0:
                continue  # graph inputs are loaded where needed, not sent
            used = min(last_use[name], len(self.nodes) - 1)
            if used > made:
                delta[made + 1] += size[name]
                delta[used + 1] -= size[name]
        crossing, running = [], 0
        for b in range(len(self.nodes) + 1):
            running += delta[b]
            crossing.append(running if 0 < b < len(self.nodes) else 0)
        return crossing


def costs_to_json(costs: GraphCosts) -> dict:
    """``costs`` as JSON-ready data: a node that plans takes them from a child that traced."""
    return {
        "nodes": [{**asdict(node), "inputs": list(node.inputs)} for node in costs.nodes],
        "input_bytes": dict(costs.input_bytes),
        "output_names": list(costs.output_names),
        "uncuttable": sorted(costs.uncuttable),
        "shared_params": [[list(users), nbytes] for users, nbytes in costs.shared_params],
    }


def costs_from_json(data: dict) -> GraphCosts:
    """The inverse of ``costs_to_json``; ValueError or TypeError on anything else."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise ValueError("graph costs must be a map with a list of nodes")
    nodes = []
    for raw in data["nodes"]:
        if not isinstance(raw, dict):
            raise ValueError(f"a graph node must be a map, got {type(raw).__name__}")
        nodes.append(OpNode(**{**raw, "inputs": tuple(raw.get("inputs", ()))}))
    return GraphCosts(
        nodes=tuple(nodes),
        input_bytes={str(k): int(v) for k, v in dict(data.get("input_bytes", {})).items()},
        output_names=tuple(str(name) for name in data.get("output_names", ())),
        uncuttable=frozenset(int(c) for c in data.get("uncuttable", ())),
        shared_params=tuple(
            (tuple(int(u) for u in users), int(nbytes))
            for users, nbytes in data.get("shared_params", ())
        ),
    )
