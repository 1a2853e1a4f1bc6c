"""``OpGraph``: a traced model as an operator DAG, its costs, and runnable stage sub-graphs.

Values are named: a graph input by its argument name, every other value by the id of the node
that makes it. A stage is any set of nodes; ``stage_module`` turns it into an fx GraphModule
whose forward maps {value name: tensor} (what the stage consumes) to {value name: tensor}
(what other stages or the model's outputs need), so running the stages in topological order
over one growing dict reproduces the whole model, skip connections across stages included.
"""

import dataclasses
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch.fx as fx

from fusionllm.common.logs import get_logger
from fusionllm.dag.cuts import uncuttable
from fusionllm.dag.flops import TensorMeta
from fusionllm.dag.graph import GraphCosts, OpNode

logger = get_logger(__name__)

ValueMeta = TensorMeta | tuple["ValueMeta", ...] | None


class OpGraph:
    """A traced model: fx GraphModule + one costed ``OpNode`` per call, in topological order.

    Built by ``fusionllm.dag.tracing.trace``; shares parameters with the traced module (and so
    do the stage modules it makes: deep-copy a stage module to give it parameters of its own).
    """

    def __init__(
        self,
        *,
        graph_module: fx.GraphModule,
        nodes: tuple[OpNode, ...],
        input_bytes: Mapping[str, int],
        output_names: tuple[str, ...],
        node_parameters: Mapping[str, tuple[str, ...]],
        canonical_names: Mapping[str, str],
        targets: Mapping[str, str],
        value_metas: Mapping[str, ValueMeta],
    ) -> None:
        self._gm = graph_module
        # GraphCosts checks ids are unique and every input is made before it is used.
        self._costs = GraphCosts(
            nodes=nodes, input_bytes=dict(input_bytes), output_names=output_names
        )
        self._costs_checked = False
        self._index = {node.node_id: i for i, node in enumerate(nodes)}
        self._node_parameters = dict(node_parameters)
        self._canonical = dict(canonical_names)
        self._targets = dict(targets)
        self._metas = dict(value_metas)
        self._fx_nodes = {node.name: node for node in graph_module.graph.nodes}
        consumers: dict[str, set[str]] = {}
        for node in nodes:
            for name in node.inputs:
                consumers.setdefault(name, set()).add(node.node_id)
        self._consumers = consumers
        self._outputs = set(output_names)

    # --- the DAG -------------------------------------------------------------------------

    @property
    def graph_module(self) -> fx.GraphModule:
        """The whole traced model (fx GraphModule); calling it equals calling the model."""
        return self._gm

    @property
    def nodes(self) -> tuple[OpNode, ...]:
        return self._costs.nodes

    @property
    def node_ids(self) -> tuple[str, ...]:
        """Node ids in a topological order (the fx graph's order)."""
        return self._costs.node_ids

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's inputs as value names, in forward's argument order."""
        return tuple(self._costs.input_bytes)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The values the model returns (flattened, first occurrence order)."""
        return self._costs.output_names

    def node(self, node_id: str) -> OpNode:
        return self.nodes[self._position(node_id)]

    def target(self, node_id: str) -> str:
        """What a node calls: a module path ("transformer.h.0.ln_1"), a function or method name."""
        self._position(node_id)
        return self._targets[node_id]

    def value_meta(self, name: str) -> ValueMeta:
        """Shape/dtype of a value for the traced batch: a TensorMeta, a tuple of them, or None."""
        if name not in self._metas:
            raise KeyError(f"no value named {name!r}")
        return self._metas[name]

    def costs(self) -> GraphCosts:
        """The pure numeric view the planner consumes, with the cuts it must not choose."""
        if not self._costs_checked:
            self._costs = dataclasses.replace(
                self._costs, uncuttable=uncuttable(self), shared_params=self._shared_costs()
            )
            self._costs_checked = True
        return self._costs

    def _shared_costs(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """GraphCosts.shared_params: each shared parameter's users (positions) and bytes."""
        params = dict(self._gm.named_parameters())  # canonical names: the first of each
        return tuple(
            (tuple(sorted(self._index[u] for u in users)), params[name].nbytes)
            for name, users in sorted(self.shared_parameters().items())
            if name in params
        )

    def model_output(self, values: Mapping[str, Any]) -> Any:
        """Rebuild what the model's forward returns (tuple, dict, ...) from named values."""
        (output,) = (n for n in self._gm.graph.nodes if n.op == "output")
        return fx.node.map_aggregate(
            output.args[0], lambda a: values[a.name] if isinstance(a, fx.Node) else a
        )

    # --- parameters ----------------------------------------------------------------------

    def node_parameters(self, node_id: str) -> tuple[str, ...]:
        """Canonical names of the parameters a node uses (a tied parameter has one name)."""
        self._position(node_id)
        return self._node_parameters[node_id]

    def canonical_parameter_names(self) -> dict[str, str]:
        """Every parameter name, as it appears in the model or a stage module -> its canonical one.

        The canonical name is the first under which the model lists the parameter, e.g. GPT-2's
        "lm_head.weight" -> "transformer.wte.weight".
        """
        return dict(self._canonical)

    def shared_parameters(self) -> dict[str, tuple[str, ...]]:
        """Canonical name -> node ids, for parameters used by more than one node.

        If those nodes land in different stages, each stage holds a copy and the copies stay
        equal only if their gradients are summed across the stages before the optimizer step.
        """
        users: dict[str, list[str]] = {}
        for node in self.nodes:
            for name in self._node_parameters[node.node_id]:
                users.setdefault(name, []).append(node.node_id)
        return {name: tuple(ids) for name, ids in users.items() if len(ids) > 1}

    # --- stages --------------------------------------------------------------------------

    def stage_inputs(self, node_ids: Iterable[str]) -> tuple[str, ...]:
        """Value names a stage consumes but does not make (graph inputs or other stages' nodes)."""
        members = self._members(node_ids)
        member_set = {node.node_id for node in members}
        needed: dict[str, None] = {}
        for node in members:
            for name in node.inputs:
                if name not in member_set:
                    needed[name] = None
        return tuple(needed)

    def stage_outputs(self, node_ids: Iterable[str]) -> tuple[str, ...]:
        """Value names a stage makes that nodes outside it, or the model's outputs, need."""
        members = self._members(node_ids)
        member_set = {node.node_id for node in members}
        return tuple(
            node.node_id
            for node in members
            if node.node_id in self._outputs
            or any(user not in member_set for user in self._consumers.get(node.node_id, ()))
        )

    def stage_module(self, node_ids: Iterable[str]) -> fx.GraphModule:
        """A GraphModule running just these nodes: forward(values: dict) -> dict.

        It reads ``stage_inputs`` from the dict it is given and returns ``stage_outputs``.
        Its parameters and buffers are the model's own, under the model's names.
        """
        members = self._members(node_ids)
        inputs = self.stage_inputs(node.node_id for node in members)
        outputs = self.stage_outputs(node.node_id for node in members)
        graph = fx.Graph()
        values = graph.placeholder("values")
        env: dict[str, fx.Node] = {}
        for name in inputs:
            env[name] = graph.create_node(
                "call_function", operator.getitem, (values, name), name=name
            )
        for member in members:
            fx_node = self._fx_nodes[member.node_id]
            for arg in fx_node.all_input_nodes:
                if arg.op == "get_attr" and arg.name not in env:
                    env[arg.name] = graph.node_copy(arg)
            env[member.node_id] = graph.node_copy(fx_node, lambda a: env[a.name])
        graph.output({name: env[name] for name in outputs})
        graph.lint()
        return fx.GraphModule(self._gm, graph, f"{type(self._gm).__name__}Stage")

    def _position(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except KeyError:
            raise KeyError(
                f"no node {node_id!r} in this graph of {len(self._index)} nodes"
            ) from None

    def _members(self, node_ids: Iterable[str]) -> list[OpNode]:
        """The stage's nodes in topological order, whatever order they were given in."""
        ids = list(node_ids)
        if not ids:
            raise ValueError("a stage needs at least one node")
        unknown = [i for i in ids if i not in self._index]
        if unknown:
            raise ValueError(f"unknown node ids {unknown[:5]} ({len(unknown)} in all)")
        if len(set(ids)) != len(ids):
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"node ids given twice: {duplicates[:5]}")
        return [self.nodes[i] for i in sorted(self._index[i] for i in ids)]

    # --- display -------------------------------------------------------------------------

    def summary(self) -> str:
        """A text table: one row per node with its shape and costs."""
        rows = [
            ("node", "op", "output", "fwd GFLOP", "bwd GFLOP", "params MB", "out MB", "saved MB")
        ]
        for node in self.nodes:
            meta = self._metas.get(node.node_id)
            shape = "x".join(map(str, meta.shape)) if isinstance(meta, TensorMeta) else "-"
            rows.append(
                (
                    node.node_id,
                    node.op,
                    shape,
                    f"{node.forward_flops / 1e9:.3f}",
                    f"{node.backward_flops / 1e9:.3f}",
                    f"{node.param_bytes / 2**20:.2f}",
                    f"{node.output_bytes / 2**20:.2f}",
                    f"{node.peak_activation_bytes / 2**20:.2f}",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
        )

    def __repr__(self) -> str:
        return (
            f"OpGraph({type(self._gm).__name__}: {len(self.nodes)} nodes, "
            f"inputs {list(self.input_names)}, outputs {list(self.output_names)})"
        )
