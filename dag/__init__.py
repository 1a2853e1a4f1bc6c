"""Operator DAG of a model, its cost model, the OP-Fence partitioner and the stage runtime.

- graph.py:   ``OpNode``, ``GraphCosts``: the data contract between tracing and planning
- tracing.py: ``trace`` (nn.Module -> OpGraph via torch.fx + shape propagation), ``TraceFailure``
- opgraph.py: ``OpGraph``: node ids, costs, shared parameters, ``stage_module`` sub-graphs
- flops.py:   per-operator FLOP / saved-activation rules, ``leaf_module`` for custom layers
- models/:    ``gpt2``, ``llama`` (Hugging Face names), ``resnet`` (torchvision names); the
              model registry; ``from_pretrained`` / ``save_pretrained`` (Hugging Face folders)
"""

from fusionllm.common.lazy_exports import lazy_exports

# Resolved on first use: planning needs graph.py alone, tracing needs torch.
_EXPORTS = {
    "GraphCosts": "fusionllm.dag.graph",
    "OpNode": "fusionllm.dag.graph",
    "OpGraph": "fusionllm.dag.opgraph",
    "TraceFailure": "fusionllm.dag.tracing",
    "trace": "fusionllm.dag.tracing",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
