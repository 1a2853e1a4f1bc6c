"""Models written to trace cleanly with torch.fx (see the OP-DAG issue)."""
