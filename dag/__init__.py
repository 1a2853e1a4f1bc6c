"""Operator DAG of a model, its cost model, the OP-Fence partitioner and the stage runtime.

- graph.py:   ``OpNode``, ``GraphCosts``: the data contract between tracing and planning
- trace.py:   ``trace`` (nn.Module -> OpGraph via torch.fx + shape propagation), ``TraceFailure``
- opgraph.py: ``OpGraph``: node ids, costs, shared parameters, ``stage_module`` sub-graphs
- flops.py:   per-operator FLOP / saved-activation rules, ``leaf_module`` for custom layers
- models/:    ``gpt2`` (Hugging Face names), ``resnet`` (torchvision names); random init
"""

from fusionllm.dag.graph import GraphCosts, OpNode
from fusionllm.dag.opgraph import OpGraph
from fusionllm.dag.trace import TraceFailure, trace

# Planner exports (cost.py, planner.py, simulate.py, swarm.py) go here.

__all__ = [
    "GraphCosts",
    "OpGraph",
    "OpNode",
    "TraceFailure",
    "trace",
]
